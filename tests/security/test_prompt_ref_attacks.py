"""Prompt refs (CoordOpenRequest.prefix_ref) against a secured cluster of real processes: an
open that names its prompt's start is placed, cached and ordered exactly as the whole prompt;
a ref of another tenant, a made-up one, or a prefix that is no whole number of the ref's
blocks is refused by name before anything is placed; a worker that names one start and
carries another to the node opens nothing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
from hostile import TOKENS, Secured, kv, status_of

from pagedkv.protos import pagedkv_pb2 as pb

BEARER = {t: (("authorization", f"Bearer {TOKENS[t]}"),) for t in TOKENS}


def _request(seq_id: str, tokens: list[int], ref: bytes = b"", prefix: int = 0) -> pb.CoordOpenRequest:
    req = pb.CoordOpenRequest(
        seq_id=seq_id, packed_token_ids=np.asarray(tokens, "<i4").tobytes(), worker_opens=True
    )
    req.carries_prompt = True
    if ref:
        req.prefix_ref = ref
    if prefix:
        req.prefix_tokens = prefix
    return req


def _counters(cluster: Secured) -> dict[str, int]:
    return dict(cluster.coordinator_stub().Stats(pb.Empty(), timeout=5).counters)


def _close(cluster: Secured, seq_id: str, tenant: str = "beta") -> None:
    cluster.coordinator_stub().Close(pb.CoordSeqRequest(seq_id=seq_id), timeout=10, metadata=BEARER[tenant])


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_ref_names_only_what_its_tenant_sent_and_a_bad_one_changes_nothing(cluster: Secured) -> None:
    stub = cluster.coordinator_stub()
    prompt = list(range(9_600, 9_900))  # 300 tokens: 18 whole blocks keyed (the last token never is)
    first = stub.Open(_request("ref-src", prompt), timeout=10, metadata=BEARER["beta"])
    assert first.prompt_ref and first.prompt_ref_tokens == 288 and first.block_size == 16
    _close(cluster, "ref-src")
    theirs = stub.Open(_request("ref-alpha", prompt), timeout=10, metadata=BEARER["alpha"])
    _close(cluster, "ref-alpha", "alpha")
    assert theirs.prompt_ref and theirs.prompt_ref != first.prompt_ref  # keyed under each tenant's salt

    tail = prompt[288:] + [7]
    before = _counters(cluster)
    cases = [
        (
            "alpha's ref",
            _request("bad", tail, theirs.prompt_ref, 288),
            "FAILED_PRECONDITION",
            "does not hold",
        ),
        ("a made-up ref", _request("bad", tail, os.urandom(16), 288), "FAILED_PRECONDITION", "does not hold"),
        ("a ragged prefix", _request("bad", tail, first.prompt_ref, 280), "INVALID_ARGUMENT", "multiple of"),
        (
            "a prefix past the ref",
            _request("bad", tail, first.prompt_ref, 304),
            "INVALID_ARGUMENT",
            "more than",
        ),
        ("a negative prefix", _request("bad", tail, first.prompt_ref, -16), "INVALID_ARGUMENT", "positive"),
        ("no prefix", _request("bad", tail, first.prompt_ref, 0), "INVALID_ARGUMENT", "positive"),
        ("a prefix, no ref", _request("bad", tail, b"", 288), "INVALID_ARGUMENT", "without a prefix_ref"),
    ]
    uncarried = _request("bad", tail, first.prompt_ref, 288)
    uncarried.carries_prompt = False
    cases.append(
        ("the prompt not carried", uncarried, "INVALID_ARGUMENT", "needs worker_opens and carries_prompt")
    )
    for name, req, code_is, says in cases:
        code, details = status_of(stub.Open, req, BEARER["beta"])
        assert code == code_is and says in details, (name, code, details)
        code, _ = status_of(stub.Describe, pb.CoordSeqRequest(seq_id="bad"), BEARER["beta"])
        assert code == "NOT_FOUND", f"{name}: a refused open left a page table"
    after = _counters(cluster)
    assert after["opens"] == before["opens"] and after["ref_opens"] == before["ref_opens"]

    named = stub.Open(_request("named", tail, first.prompt_ref, 288), timeout=10, metadata=BEARER["beta"])
    whole = stub.Open(_request("whole", prompt + [7]), timeout=10, metadata=BEARER["beta"])
    _close(cluster, "named")
    _close(cluster, "whole")
    order, whole_order = (pb.OpenRequest.FromString(r.node_open.order) for r in (named, whole))
    assert order.prompt_tokens == whole_order.prompt_tokens == 301
    assert named.num_cached_tokens == whole.num_cached_tokens and order.prompt_key == whole_order.prompt_key
    assert named.prompt_ref == whole.prompt_ref  # the same prompt: the same ref
    assert _counters(cluster)["ref_opens"] == after["ref_opens"] + 1


def test_a_named_start_hits_the_cache_and_carrying_another_opens_nothing(cluster: Secured) -> None:
    """The library names the start by itself (its second open of a prompt sends a ref), hits
    the KV the first open cached, and reads it back exactly; an order got by naming one start
    and carried with other tokens is refused by the node."""
    beta = cluster.clients["beta"]
    beta.open("refd-first", [1, 2, 3]).close()  # a client's first open goes as varints (no ref)
    prompt = list(range(9_900, 10_030))  # 8 whole blocks and 2 tokens
    k, v = kv(prompt, seed=11)
    with beta.open("refd-src", prompt) as seq:
        seq.append(
            prompt[seq.num_cached_tokens :], k[:, seq.num_cached_tokens :], v[:, seq.num_cached_tokens :]
        )
    _wait_for(lambda: beta.lookup(prompt + [1]) == 128)
    named_before = _counters(cluster)["ref_opens"]
    with beta.open("refd-hit", prompt + [3]) as hit:
        assert hit.num_cached_tokens == 128
        got_k, got_v = hit.read_kv()
        assert np.array_equal(got_k[:, :128].numpy(), k[:, :128].numpy())
        assert np.array_equal(got_v[:, :128].numpy(), v[:, :128].numpy())
    assert _counters(cluster)["ref_opens"] == named_before + 1, "the library sent the prompt whole"

    stub = cluster.coordinator_stub()
    src = stub.Open(_request("refd-ref", prompt + [4]), timeout=10, metadata=BEARER["beta"])
    _close(cluster, "refd-ref")
    reply = stub.Open(_request("refd-liar", [4, 5], src.prompt_ref, 128), timeout=10, metadata=BEARER["beta"])
    assert reply.num_cached_tokens == 128
    address = reply.extents[0].address
    node = cluster.node_stub(address)
    before = int(node.Stats(pb.Empty(), timeout=5).counters["num_sequences"])
    liar = pb.SignedOpen()
    liar.CopyFrom(reply.node_open)
    liar.packed_token_ids = np.asarray([9] * 128, "<i4").tobytes()  # not the start it named
    code, details = status_of(node.OpenSigned, liar)
    assert code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"), (code, details)
    assert int(node.Stats(pb.Empty(), timeout=5).counters["num_sequences"]) == before
    _close(cluster, "refd-liar")
