"""The signed open order's pieces: its MAC (protos/tickets.py), the node's check in each
trust mode (Gate.check_order) and the node's memory of orders that ran (OpenOrders)."""

from __future__ import annotations

import pytest

from pagedkv.cache_node.gate import Credentials, Gate, NodeTrust
from pagedkv.cache_node.orders import OpenOrders, order_digest
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import FailedPrecondition, PermissionDenied, Unauthenticated, Unavailable
from pagedkv.protos.tickets import ClusterKeys, check_order, order_tag, seal_salt, unseal_salt

KEYS = ClusterKeys([b"k" * 32])
OTHER = ClusterKeys([b"o" * 32])
ORDER = pb.OpenRequest(seq_id="t/s", token_ids=[1, 2, 3], tenant_salt=b"s" * 16).SerializeToString()
NOW = 1_000_000.0


def test_the_tag_binds_order_node_registration_and_expiry() -> None:
    tag = order_tag(KEYS, ORDER, "n1", 7, 2_000_000)
    assert check_order(KEYS, ORDER, tag, "n1", 7, 2_000_000)
    assert not check_order(OTHER, ORDER, tag, "n1", 7, 2_000_000)  # another cluster's key
    assert not check_order(KEYS, ORDER + b"\x00", tag, "n1", 7, 2_000_000)
    assert not check_order(KEYS, ORDER, tag, "n2", 7, 2_000_000)
    assert not check_order(KEYS, ORDER, tag, "n1", 8, 2_000_000)
    assert not check_order(KEYS, ORDER, tag, "n1", 7, 2_000_001)
    assert not check_order(KEYS, ORDER, b"", "n1", 7, 2_000_000)
    # a rotated-in key still verifies what the old first key signed
    assert check_order(ClusterKeys([b"o" * 32, b"k" * 32]), ORDER, tag, "n1", 7, 2_000_000)


def test_the_salt_travels_sealed_and_opens_with_the_key_that_signed() -> None:
    salt = bytes(range(16))
    where = ("n1", 7, 2_000_000, "t/s")
    sealed = seal_salt(KEYS, salt, *where)
    assert sealed != salt and len(sealed) == len(salt)
    assert seal_salt(KEYS, salt, "n1", 7, 2_000_000, "t/other") != sealed  # a keystream per order
    tag = order_tag(KEYS, b"order", "n1", 7, 2_000_000)
    assert unseal_salt(KEYS, sealed, tag, *where) == salt
    rotated = ClusterKeys([b"o" * 32, b"k" * 32])  # the signer's key now second: still opens it
    assert unseal_salt(rotated, sealed, tag, *where) == salt
    assert unseal_salt(KEYS, sealed, tag, "n1", 7, 2_000_000, "t/x") != salt
    long_salt = bytes(range(40))  # longer than one HMAC block
    assert unseal_salt(KEYS, seal_salt(KEYS, long_salt, *where), tag, *where) == long_salt


def _cluster_gate(epoch: int | None = 7) -> Gate:
    gate = Gate(NodeTrust(keys=KEYS, node_id="n1"), clock=lambda: NOW)
    if epoch is not None:
        gate.set_registration("n1", epoch)
    return gate


def test_a_cluster_node_takes_only_a_live_order_signed_for_its_registration() -> None:
    gate, creds = _cluster_gate(), Credentials()
    expires = int(NOW) + 60
    tag = order_tag(KEYS, ORDER, "n1", 7, expires)
    gate.check_order(creds, ORDER, tag, "n1", 7, expires)  # passes
    with pytest.raises(Unauthenticated, match="not signed by this cluster"):
        gate.check_order(creds, ORDER, order_tag(OTHER, ORDER, "n1", 7, expires), "n1", 7, expires)
    with pytest.raises(FailedPrecondition, match="re-registered"):
        gate.check_order(creds, ORDER, order_tag(KEYS, ORDER, "n1", 6, expires), "n1", 6, expires)
    with pytest.raises(FailedPrecondition, match="reached node 'n1'"):
        gate.check_order(creds, ORDER, order_tag(KEYS, ORDER, "n2", 7, expires), "n2", 7, expires)
    past = int(NOW) - 1
    with pytest.raises(FailedPrecondition, match="expired"):
        gate.check_order(creds, ORDER, order_tag(KEYS, ORDER, "n1", 7, past), "n1", 7, past)
    with pytest.raises(Unavailable, match="has not registered"):
        _cluster_gate(None).check_order(creds, ORDER, tag, "n1", 7, expires)
    gate.fence("a stall")  # fenced: the order still runs (its data calls wait for the lease)
    gate.check_order(creds, ORDER, tag, "n1", 7, expires)
    with pytest.raises(Unavailable, match="cannot prove its lease"):
        gate.require(creds, ["t/s"], 0, "Append")


def test_without_a_secret_an_order_is_an_open_but_never_for_another_registration() -> None:
    gate = Gate()  # open mode: a trusted network
    gate.check_order(Credentials(), ORDER, b"", "", 0, 0)  # not registered: anything goes
    gate.set_registration("n1", 3)
    gate.check_order(Credentials(), ORDER, b"", "n1", 3, 0)
    with pytest.raises(FailedPrecondition, match="registration 2"):
        gate.check_order(Credentials(), ORDER, b"", "n1", 2, 0)
    token = Gate(NodeTrust(token="secret-token"))  # a standalone node: its token, as for Open
    with pytest.raises(Unauthenticated, match="bearer token"):
        token.check_order(Credentials(), ORDER, b"", "", 0, 0)
    token.check_order(Credentials(is_owner=True), ORDER, b"", "", 0, 0)


def test_an_order_runs_once_a_retry_gets_its_reply_a_replay_is_refused() -> None:
    clock = [NOW]
    orders = OpenOrders(capacity=3, clock=lambda: clock[0])
    open_ids = {"t/s"}
    digest = order_digest(ORDER)
    assert orders.prior(digest, open_ids.__contains__) is None
    reply = pb.OpenResponse(num_cached_tokens=16)
    orders.ran(digest, int(NOW) + 60, "t/s", reply)
    assert orders.prior(digest, open_ids.__contains__) == reply
    open_ids.clear()  # freed since
    with pytest.raises(FailedPrecondition, match="ran already"):
        orders.prior(digest, open_ids.__contains__)
    # expired orders are forgotten (the node's check refuses them before this memory)
    clock[0] = NOW + 61
    orders.ran(b"x" * 16, int(clock[0]) + 60, "t/x", reply)
    assert orders.prior(digest, open_ids.__contains__) is None
    # and past capacity the oldest go first
    for i in range(4):
        orders.ran(bytes([i]) * 16, int(clock[0]) + 60, f"t/{i}", reply)
    assert orders.prior(b"x" * 16, lambda _: True) is None
    assert orders.prior(bytes([3]) * 16, lambda _: True) == reply


def test_a_node_order_is_refused_on_a_worker_ticket_path_too() -> None:
    """A data ticket is no licence for the ADMIN Open: OpenSigned is the worker's only way in."""
    gate = _cluster_gate()
    with pytest.raises(PermissionDenied, match="only its coordinator may call it"):
        gate.require_admin(Credentials(), "Open")
