"""Every bad input gets a clear domain error and leaves the engine exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import Q_HEADS, SPEC, assert_unchanged, fill, kv_for, make_engine, snapshot

from pagedkv.cache_node.engine import EngineConfig
from pagedkv.protos.errors import (
    CapacityExceeded,
    FailedPrecondition,
    InvalidArgument,
    PagedKVError,
    SequenceNotFound,
    SpecMismatch,
)
from pagedkv.protos.spec import ModelSpec

D, HK = SPEC.head_dim, SPEC.num_kv_heads


@pytest.fixture
def engine():
    """Two live sequences sharing a prefix, one forked, one swapped out."""
    e = make_engine(num_blocks=8, num_host_blocks=3)
    fill(e, "a", list(range(10)), seed=1)
    fill(e, "b", list(range(10)) + [7], seed=1)
    e.fork("a", "a2")
    fill(e, "s", [3, 3], seed=2)
    e.swap_out("s")
    e.check_integrity()
    return e


def q1(n=1, heads=Q_HEADS):
    return torch.randn(n, heads, D)


BAD_CALLS = {
    "append k wrong dtype": (
        lambda e: e.append("a", [1], torch.zeros(2, 1, HK, D, dtype=torch.float64), torch.zeros(2, 1, HK, D)),
        InvalidArgument,
        "k has dtype float64, this node serves float32",
    ),
    "append k wrong shape": (
        lambda e: e.append("a", [1, 2], *kv_for(1, 0)),
        InvalidArgument,
        r"k has shape \(2, 1, 2, 8\), expected \(2, 2, 2, 8\)",
    ),
    "append unknown sequence": (lambda e: e.append("zz", [1], *kv_for(1, 0)), SequenceNotFound, "'zz'"),
    "append to swapped": (lambda e: e.append("s", [1], *kv_for(1, 0)), FailedPrecondition, "swapped out"),
    "append not a tensor": (
        lambda e: e.append("a", [1], [[1.0]], [[1.0]]),
        InvalidArgument,
        "must be a tensor",
    ),
    "token id negative": (lambda e: e.append("a", [-1], *kv_for(1, 0)), InvalidArgument, "token id -1"),
    "token id float": (lambda e: e.open("n", [1.5, 2]), InvalidArgument, "token id 1.5"),
    "token ids float array": (
        lambda e: e.open("n", np.array([1.0, 2.0])),
        InvalidArgument,
        "1-D integer array",
    ),
    "pool full": (lambda e: e.append("a", list(range(40)), *kv_for(40, 0)), CapacityExceeded, "requested"),
    "open existing id": (lambda e: e.open("a", [1, 2, 3]), InvalidArgument, "already exists"),
    "open empty id": (lambda e: e.open("", [1]), InvalidArgument, "non-empty string"),
    "fork onto existing": (lambda e: e.fork("a", "b"), InvalidArgument, "'b' already exists"),
    "fork unknown": (lambda e: e.fork("nope", "c"), SequenceNotFound, "nope"),
    "free unknown": (lambda e: e.free("nope"), SequenceNotFound, "nope"),
    "swap in active": (lambda e: e.swap_in("a"), FailedPrecondition, "not swapped out"),
    "swap out swapped": (lambda e: e.swap_out("s"), FailedPrecondition, "swapped out"),
    "swap out too big for host": (
        lambda e: e.swap_out("b"),
        CapacityExceeded,
        "swap out sequence 'b' to host: requested 3 blocks, only 2 available",
    ),
    "decode layer out of range": (
        lambda e: e.attend_decode(["a"], 2, q1()),
        InvalidArgument,
        r"layer 2 out of range \[0, 2\)",
    ),
    "decode duplicate sequence": (
        lambda e: e.attend_decode(["a", "a"], 0, q1(2), torch.zeros(2, HK, D), torch.zeros(2, HK, D), [1, 2]),
        InvalidArgument,
        "more than once",
    ),
    "decode q heads not multiple": (
        lambda e: e.attend_decode(["a"], 0, q1(1, heads=3)),
        InvalidArgument,
        "multiple of 2 kv heads",
    ),
    "decode missing token ids at layer 0": (
        lambda e: e.attend_decode(["a"], 0, q1(), torch.zeros(1, HK, D), torch.zeros(1, HK, D)),
        InvalidArgument,
        "token_ids are required",
    ),
    "decode token ids at layer 1": (
        lambda e: e.attend_decode(["a"], 1, q1(), torch.zeros(1, HK, D), torch.zeros(1, HK, D), [1]),
        InvalidArgument,
        "layer 0 only",
    ),
    "decode k without v": (
        lambda e: e.attend_decode(["a"], 0, q1(), torch.zeros(1, HK, D)),
        InvalidArgument,
        "together",
    ),
    "decode token count mismatch": (
        lambda e: e.attend_decode(["a"], 0, q1(), torch.zeros(1, HK, D), torch.zeros(1, HK, D), [1, 2]),
        InvalidArgument,
        "2 token ids for 1 new tokens",
    ),
    "decode with one unknown sequence": (
        lambda e: e.attend_decode(
            ["a", "ghost"], 0, q1(2), torch.zeros(2, HK, D), torch.zeros(2, HK, D), [1, 2]
        ),
        SequenceNotFound,
        "ghost",
    ),
    "decode with one swapped sequence": (
        lambda e: e.attend_decode(["a", "s"], 0, q1(2), torch.zeros(2, HK, D), torch.zeros(2, HK, D), [1, 2]),
        FailedPrecondition,
        "'s' is swapped out",
    ),
    "prefill more queries than tokens": (
        lambda e: e.attend_prefill("a", 0, q1(11)),
        InvalidArgument,
        "holds 10 tokens, fewer than 11 queries",
    ),
    "read_kv out of range": (lambda e: e.read_kv("a", 5, 11), InvalidArgument, r"range \[5, 11\)"),
    "unpin never pinned": (lambda e: e.unpin(list(range(10))), InvalidArgument, "no pinned prefix"),
    "budget too small": (lambda e: e.set_budget("a", 4), InvalidArgument, "max_tokens >="),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_is_refused_and_changes_nothing(engine, name):
    call, error, message = BAD_CALLS[name]
    before = snapshot(engine)
    with pytest.raises(error, match=message):
        call(engine)
    assert_unchanged(before, engine)


def test_every_error_is_a_pagedkv_error_with_a_status():
    for _, error, _ in BAD_CALLS.values():
        assert issubclass(error, PagedKVError) and error.status_name != "UNKNOWN"


def test_full_pool_decode_step_fails_whole_and_then_succeeds_after_free():
    e = make_engine(num_blocks=2, num_host_blocks=0)
    fill(e, "a", [1, 2, 3, 4], seed=1)  # one full block
    fill(e, "b", [5, 6, 7, 8], seed=2)  # the other
    before = snapshot(e)
    z = torch.zeros(2, HK, D)
    with pytest.raises(CapacityExceeded, match="decode step for 2 sequences: requested 2 blocks, only 0"):
        e.attend_decode(["a", "b"], 0, q1(2), z, z, [9, 9])
    assert_unchanged(before, e)
    e.free("b")
    out = e.attend_decode(["a"], 0, q1(), z[:1], z[:1], [9])
    assert out.out.shape == (1, Q_HEADS, D)
    e.check_integrity()


def test_spec_and_config_validation_name_the_field():
    with pytest.raises(InvalidArgument, match="ModelSpec.head_dim must be a positive int, got 0"):
        ModelSpec(2, 2, 0)
    with pytest.raises(InvalidArgument, match="ModelSpec.dtype must be one of"):
        ModelSpec(2, 2, 8, dtype="int8")
    with pytest.raises(InvalidArgument, match="unknown eviction policy 'fifo'"):
        EngineConfig(SPEC, 4, policy="fifo")
    with pytest.raises(SpecMismatch, match="head_dim: 16 != 8"):
        SPEC.check_same(ModelSpec(2, 2, 16, block_size=4))
