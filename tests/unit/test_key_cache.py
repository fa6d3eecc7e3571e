"""ChainKeyCache (coordinator/key_cache.py): whatever prompts came before, under whichever roots,
an open's keys are exactly chain_keys_packed's; shared prefixes are really reused; what the
cache holds stays bounded and never aliases a caller's array that may change."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.coordinator.key_cache import ChainKeyCache
from pagedkv.protos.keys import chain_keys_packed, root_key

ROOTS = [root_key(b"a"), root_key(b"b")]


@st.composite
def prompts(draw: Any) -> list[tuple[bytes, np.ndarray, int]]:
    """Prompts that share prefixes of each other (and a few that do not), as int32 views of
    bytes (a packed request), int64 arrays and uint32 arrays."""
    base = draw(st.lists(st.integers(0, 50), min_size=0, max_size=40))
    out = []
    for _ in range(draw(st.integers(1, 8))):
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 50), max_size=20))
        tokens = base[:cut] + tail
        kind = draw(st.sampled_from(["packed", "int64", "uint32"]))
        if kind == "packed":
            arr = np.frombuffer(np.asarray(tokens, dtype="<i4").tobytes(), dtype="<i4")
        else:
            arr = np.asarray(tokens, dtype=np.int64 if kind == "int64" else np.uint32)
        out.append((draw(st.sampled_from(ROOTS)), arr, draw(st.sampled_from([1, 2, 4]))))
    return out


@settings(max_examples=300, deadline=None)
@given(seq=prompts(), max_tokens=st.sampled_from([8, 64, 1 << 20]))
def test_the_keys_are_chain_keys_whatever_came_before(
    seq: list[tuple[bytes, np.ndarray, int]], max_tokens: int
) -> None:
    cache = ChainKeyCache(max_tokens)
    for root, tokens, block_size in seq:
        assert cache.keys(root, tokens, block_size) == chain_keys_packed(root, tokens, block_size)
        assert cache.num_tokens <= max_tokens


def test_a_shared_prefix_is_hashed_once_and_a_root_never_lends_to_another() -> None:
    cache = ChainKeyCache()
    system = list(range(1000, 1000 + 16 * 64))  # 64 blocks of a system prompt
    for i in range(3):
        tokens = np.asarray(system + [i] * 16)  # and a block of its own
        assert cache.keys(ROOTS[0], tokens, 16) == chain_keys_packed(ROOTS[0], tokens, 16)
    assert (cache.hashed_blocks, cache.reused_blocks) == (65 + 1 + 1, 64 + 64)
    other = np.asarray(system + [0] * 16)  # the same tokens under another tenant's root
    assert cache.keys(ROOTS[1], other, 16) == chain_keys_packed(ROOTS[1], other, 16)
    assert cache.hashed_blocks == 67 + 65


def test_a_callers_array_changed_afterwards_does_not_change_later_keys() -> None:
    cache = ChainKeyCache()
    tokens = np.arange(64, dtype=np.int64)
    cache.keys(ROOTS[0], tokens, 8)
    tokens[40] = 999  # the caller reuses its buffer
    again = np.arange(64, dtype=np.int64)
    assert cache.keys(ROOTS[0], again, 8) == chain_keys_packed(ROOTS[0], again, 8)
    assert cache.reused_blocks == 8  # (held a copy: the whole prompt came from it)
    changed = again.copy()
    changed[40] = 999  # what a held view would have claimed to know
    assert cache.keys(ROOTS[0], changed, 8) == chain_keys_packed(ROOTS[0], changed, 8)


@pytest.mark.parametrize(
    "bad", [np.arange(32, dtype=np.float64), np.arange(32, dtype=np.uint64), np.zeros((4, 8), dtype=np.int64)]
)
def test_what_chain_keys_refuses_is_refused_even_after_equal_values(bad: np.ndarray) -> None:
    cache = ChainKeyCache()
    cache.keys(ROOTS[0], np.arange(32, dtype=np.int64), 8)  # equal values, a good dtype
    with pytest.raises(ValueError):
        chain_keys_packed(ROOTS[0], bad, 8)
    with pytest.raises(ValueError):
        cache.keys(ROOTS[0], bad, 8)
