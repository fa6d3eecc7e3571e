"""The node Open a worker carries (CoordOpenRequest.worker_opens -> CacheNode.OpenSigned),
attacked: the attacker (tenant beta) holds a real order the coordinator signed for it and
alters, misdirects, ages and replays it. Each is refused with the right status before
anything opens; the honest order runs once (a retry answers the first run's reply)."""

from __future__ import annotations

import time
from collections.abc import Callable

from hostile import TOKENS, Secured, kv, status_of

from pagedkv.protos import pagedkv_pb2 as pb

BEARER = (("authorization", f"Bearer {TOKENS['beta']}"),)


def _order(cluster: Secured, seq_id: str) -> pb.CoordOpenResponse:
    stub = cluster.coordinator_stub()
    req = pb.CoordOpenRequest(seq_id=seq_id, token_ids=[9_100, 9_101, 9_102], worker_opens=True)
    reply = stub.Open(req, timeout=10, metadata=BEARER)
    assert reply.HasField("node_open") and reply.node_open.tag, "a secured coordinator signs the order"
    return reply


def test_a_worker_never_reads_its_tenants_salt_in_an_order(cluster: Secured) -> None:
    """The order carries the salt sealed with a keystream of that order: two orders of one
    tenant carry different bytes where the salt is the same."""
    salts = set()
    for seq_id in ("sealed-1", "sealed-2"):
        reply = _order(cluster, seq_id)
        salts.add(pb.OpenRequest.FromString(reply.node_open.order).tenant_salt)
        cluster.node_stub(reply.extents[0].address).OpenSigned(reply.node_open, timeout=10)
        cluster.coordinator_stub().Close(pb.CoordSeqRequest(seq_id=seq_id), timeout=10, metadata=BEARER)
    assert len(salts) == 2


def test_a_prefix_cached_through_a_carried_order_is_found_again(cluster: Secured) -> None:
    """The node unseals the salt right: blocks a worker-carried open cached are keyed as the
    coordinator keys them, so the next open of the prompt hits them (on the same node)."""
    beta = cluster.clients["beta"]
    prompt = list(range(9_200, 9_200 + 33))  # two whole blocks and one token
    with beta.open("salted-1", prompt) as first:
        first.append(prompt, *kv(prompt, seed=5))
    deadline = time.monotonic() + 10
    while True:  # the node reports its new blocks to the coordinator within ~10 ms
        with beta.open("salted-2", prompt + [1]) as second:
            if second.num_cached_tokens == 32:
                break
        assert time.monotonic() < deadline, "the cached prefix was never found"
        time.sleep(0.05)


def _num_sequences(cluster: Secured, address: str) -> int:
    return int(cluster.node_stub(address).Stats(pb.Empty(), timeout=5).counters["num_sequences"])


def test_an_altered_misdirected_or_stale_order_opens_nothing(cluster: Secured) -> None:
    reply = _order(cluster, "order-1")
    address = reply.extents[0].address
    stub = cluster.node_stub(address)
    good = reply.node_open
    other = next(a for a in cluster.node_addresses() if a != address)
    before = _num_sequences(cluster, address)

    order = pb.OpenRequest.FromString(good.order)
    cases = []
    changes = (("tenant_salt", b"\x00" * 16), ("expect_cached_tokens", order.expect_cached_tokens + 16))
    for field, value in (*changes, ("max_blocks", 10**6)):
        altered = pb.OpenRequest()
        altered.CopyFrom(order)
        setattr(altered, field, value)
        cases.append((f"altered {field}", _with(good, order=altered.SerializeToString())))
    cases += [
        ("forged tag", _with(good, tag=bytes(len(good.tag)))),
        ("no tag", _with(good, tag=b"")),
        ("a longer life", _with(good, expires_at=good.expires_at + 3600)),
    ]
    for name, signed in cases:
        code, details = status_of(stub.OpenSigned, signed)
        assert code == "UNAUTHENTICATED" and "not signed by this cluster's key" in details, (
            name,
            code,
            details,
        )
    stale = [
        ("expired", _with(good, expires_at=1), "expired"),
        (
            "an earlier registration",
            _with(good, epoch=good.epoch - 1),
            "re-registered",
        ),
    ]
    for name, signed, says in stale:
        code, details = status_of(stub.OpenSigned, signed)
        assert code == "FAILED_PRECONDITION" and says in details, (name, code, details)
    code, details = status_of(cluster.node_stub(other).OpenSigned, good)  # the right order, the wrong node
    assert code == "FAILED_PRECONDITION" and "reached node" in details, (code, details)
    code, details = status_of(stub.OpenSigned, pb.SignedOpen(order=b"\xff" * 9, tag=good.tag))
    assert code in ("UNAUTHENTICATED", "FAILED_PRECONDITION"), (code, details)
    assert _num_sequences(cluster, address) == before, "a refused order opened something"

    first = stub.OpenSigned(good, timeout=10)  # the honest order
    assert _num_sequences(cluster, address) == before + 1
    again = stub.OpenSigned(good, timeout=10)  # a retry after a lost reply: the same answer, once
    assert again == first and _num_sequences(cluster, address) == before + 1
    # closed through the coordinator, which frees it on its node
    cluster.coordinator_stub().Close(pb.CoordSeqRequest(seq_id="order-1"), timeout=10, metadata=BEARER)
    _wait_for(lambda: _num_sequences(cluster, address) == before)
    code, details = status_of(stub.OpenSigned, good)  # replayed after the close
    assert code == "FAILED_PRECONDITION" and "ran already" in details, (code, details)
    assert _num_sequences(cluster, address) == before, "a replayed order brought a closed sequence back"


def _with(signed: pb.SignedOpen, **changes: object) -> pb.SignedOpen:
    out = pb.SignedOpen()
    out.CopyFrom(signed)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def _wait_for(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
