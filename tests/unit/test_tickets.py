"""Tickets and the node's gate, without a network: what is signed, what verifies, key
rotation with two keys accepted at once, and the gate's answers in each mode."""

from __future__ import annotations

import time

import pytest

from pagedkv.cache_node.gate import Gate, NodeTrust
from pagedkv.client.transport.tickets import Wallet
from pagedkv.protos.errors import (
    InvalidArgument,
    PermissionDenied,
    SequenceLost,
    SequenceNotFound,
    Unauthenticated,
    Unavailable,
)
from pagedkv.protos.tickets import (
    RIGHT_ADMIN,
    RIGHT_DATA,
    RIGHT_READ,
    RIGHT_WRITE,
    TICKET_KEY,
    ClusterKeys,
    Ticket,
    Verifier,
    issue,
    parse,
)

OLD = b"old-secret-" + b"o" * 32
NEW = b"new-secret-" + b"n" * 32


def ticket(seq_id: str = "acme/s", node: str = "n1", epoch: int = 7, ttl: int = 60, rights: int = RIGHT_DATA):
    return Ticket(rights, int(time.time()) + ttl, epoch, "acme", seq_id, node)


def test_a_ticket_round_trips_and_a_changed_byte_is_refused() -> None:
    keys = ClusterKeys([OLD])
    raw = issue(keys, ticket())
    assert parse(raw) == ticket()._replace(expires_at=parse(raw).expires_at)
    v = Verifier(keys)
    assert v.verify(raw).seq_id == "acme/s"
    for i in range(len(raw)):
        bent = raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1 :]
        with pytest.raises(Unauthenticated):
            Verifier(keys).verify(bent)


def test_rotation_accepts_two_keys_and_signs_with_the_first() -> None:
    old, both_old_first, both_new_first, new = (
        ClusterKeys([OLD]),
        ClusterKeys([OLD, NEW]),
        ClusterKeys([NEW, OLD]),
        ClusterKeys([NEW]),
    )
    # step 1: every process accepts both, still signs with the old one
    assert Verifier(both_old_first).verify(issue(old, ticket()))
    assert Verifier(old).verify(issue(both_old_first, ticket()))
    # step 2: the new key signs; processes not yet moved still accept it
    assert Verifier(both_old_first).verify(issue(both_new_first, ticket()))
    assert Verifier(both_new_first).verify(issue(old, ticket()))
    # step 3: the old key is gone: its tickets are refused
    with pytest.raises(Unauthenticated, match="not signed by this cluster's key"):
        Verifier(new).verify(issue(old, ticket()))


def test_cluster_secrets_are_read_from_text_files_and_env(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text(f"# rotation: the first signs\n{NEW.decode()}\n\n{OLD.decode()}\n")
    keys = ClusterKeys.from_env({"PAGEDKV_CLUSTER_SECRET_FILE": str(path)})
    assert keys is not None and keys.num_keys == 2
    assert Verifier(ClusterKeys([OLD])).keys.check(b"x", keys.mac(b"x")) is False  # signed with NEW
    assert ClusterKeys.from_env({"PAGEDKV_CLUSTER_SECRET": f"{OLD.decode()},{NEW.decode()}"}).num_keys == 2  # type: ignore[union-attr]
    assert ClusterKeys.from_env({}) is None
    with pytest.raises(InvalidArgument, match="too short"):
        ClusterKeys.from_text("short")
    with pytest.raises(InvalidArgument, match="same key twice"):
        ClusterKeys([OLD, OLD])


def _gate(mode: str = "cluster") -> Gate:
    keys = ClusterKeys([OLD]) if mode == "cluster" else None
    gate = Gate(NodeTrust(keys, "tok" if mode == "token" else "", "n1"))
    if mode == "cluster":
        gate.set_registration("n1", 7)
    return gate


def test_the_gate_in_cluster_mode() -> None:
    keys = ClusterKeys([OLD])
    gate = _gate()
    creds = gate.from_metadata(((TICKET_KEY, issue(keys, ticket())),))
    gate.require(creds, ["acme/s"], RIGHT_READ | RIGHT_WRITE, "Attend")
    with pytest.raises(PermissionDenied, match="no ticket for sequence 'acme/other'"):
        gate.require(creds, ["acme/s", "acme/other"], RIGHT_READ, "Attend")
    with pytest.raises(PermissionDenied, match="only its coordinator"):
        gate.require_admin(creds, "Open")
    with pytest.raises(Unauthenticated, match="none presented"):
        gate.require(gate.from_metadata(()), ["acme/s"], RIGHT_READ, "ReadKV")
    with pytest.raises(Unauthenticated, match="presented to node"):
        gate.from_metadata(((TICKET_KEY, issue(keys, ticket(node="n2"))),))
    with pytest.raises(Unauthenticated, match="expired"):
        gate.require(
            gate.from_metadata(((TICKET_KEY, issue(keys, ticket(ttl=-5))),)), ["acme/s"], 1, "ReadKV"
        )
    with pytest.raises(SequenceLost, match="earlier registration of node 'n1'"):
        gate.require(
            gate.from_metadata(((TICKET_KEY, issue(keys, ticket(epoch=6))),)), ["acme/s"], 1, "ReadKV"
        )
    read_only = gate.from_metadata(((TICKET_KEY, issue(keys, ticket(rights=RIGHT_READ))),))
    with pytest.raises(PermissionDenied):
        gate.require(read_only, ["acme/s"], RIGHT_READ | RIGHT_WRITE, "Append")
    admin = gate.from_metadata(((TICKET_KEY, issue(keys, ticket(seq_id="", rights=RIGHT_ADMIN))),))
    gate.require_admin(admin, "Open")
    gate.require(admin, ["anyone/s"], RIGHT_DATA, "ReadKV")
    gate.set_registration("n1", 8)  # re-registered: the coordinator's old credential is void too
    with pytest.raises(PermissionDenied):
        gate.require_admin(admin, "Open")


def test_the_gate_before_registration_and_in_the_other_modes() -> None:
    unregistered = Gate(NodeTrust(ClusterKeys([OLD]), "", "n1"))
    with pytest.raises(Unavailable, match="has not registered"):
        unregistered.require_admin(unregistered.from_metadata(()), "Open")
    token = _gate("token")
    with pytest.raises(Unauthenticated, match="bearer token"):
        token.require(token.from_metadata(()), ["s"], RIGHT_READ, "ReadKV")
    with pytest.raises(Unauthenticated, match="wrong bearer token"):
        token.from_metadata((("authorization", "Bearer nope"),))
    owner = token.from_metadata((("authorization", "Bearer tok"),))
    token.require_admin(owner, "Open")
    token.require(owner, ["s"], RIGHT_DATA, "Append")
    open_gate = _gate("open")
    open_gate.require_admin(open_gate.from_metadata(()), "Open")


def test_the_gate_reserves_quota_before_an_append_that_needs_it() -> None:
    gate = _gate()
    asked: list[tuple[str, int, int]] = []

    def reserve(seq_id: str, least: int, wanted: int) -> int:
        asked.append((seq_id, least, wanted))
        return 2 + wanted

    gate.reserve = reserve
    gate.set_allowance("acme/s", 2)
    held = {"acme/s": 30}  # tokens; 2 blocks of 16
    with gate.charging(["acme/s"], [2], held.__getitem__, 16):  # 32 tokens: still 2 blocks
        pass
    assert asked == []
    with gate.charging(["acme/s"], [3], held.__getitem__, 16):  # 33: a third block
        pass
    assert asked == [("acme/s", 1, 8)] and gate.allowance("acme/s") == 10

    def unknown(seq_id: str) -> int:
        raise SequenceNotFound(seq_id)

    with pytest.raises(SequenceNotFound), gate.charging(["acme/s"], [100], unknown, 16):
        pass  # (the engine's answer for an unknown sequence passes through)
    with gate.charging(["other"], [10**6], held.__getitem__, 16):  # no allowance: no check
        pass


def test_a_wallet_translates_ids_and_errors() -> None:
    w = Wallet()
    assert w.is_empty and w.node_ids(["a"]) == ["a"] and w.metadata(["a"]) == ()
    w.add("a", "acme/a", b"T")
    assert w.node_id("a") == "acme/a" and w.node_ids(["a", "b"]) == ["acme/a", "b"]
    assert w.metadata(["acme/a", "b"]) == ((TICKET_KEY, b"T"),)
    err = w.worker_error(SequenceNotFound("acme/a"))
    assert isinstance(err, SequenceNotFound) and err.seq_id == "a" and "'a'" in str(err)
    w.forget("a")
    assert w.is_empty and w.node_id("a") == "a"
    assert Wallet("tok").metadata(["x"]) == (("authorization", "Bearer tok"),)


def test_a_free_takes_the_sequences_write_ticket_or_the_coordinators() -> None:
    """A worker's close frees its sequence with its ticket, checked as a data call (fenced,
    lost); the coordinator's ADMIN ticket frees as before, fenced or not."""
    keys = ClusterKeys([OLD])
    gate = _gate()
    own = gate.from_metadata(((TICKET_KEY, issue(keys, ticket())),))
    gate.require_free(own, "acme/s")
    with pytest.raises(PermissionDenied, match="no ticket for sequence 'acme/other'"):
        gate.require_free(own, "acme/other")
    read_only = gate.from_metadata(((TICKET_KEY, issue(keys, ticket(rights=RIGHT_READ))),))
    with pytest.raises(PermissionDenied):
        gate.require_free(read_only, "acme/s")
    with pytest.raises(Unauthenticated, match="none presented"):
        gate.require_free(gate.from_metadata(()), "acme/s")
    admin = gate.from_metadata(((TICKET_KEY, issue(keys, ticket(seq_id="", rights=RIGHT_ADMIN))),))
    gate.fence("cut off")
    with pytest.raises(Unavailable, match="cannot prove its lease"):
        gate.require_free(own, "acme/s")
    gate.require_free(admin, "acme/s")  # the coordinator's Free is not fenced
    gate.lease_renewed(time.monotonic(), 10.0, 1.0)
    gate.mark_lost(["acme/s"], "node n1 was reset")
    with pytest.raises(SequenceLost, match="reset"):
        gate.require_free(own, "acme/s")
    # Without a cluster secret nobody presents anything: every Free is checked as a data call.
    open_gate = _gate("open")
    nobody = open_gate.from_metadata(())
    open_gate.require_free(nobody, "s")
    open_gate.keep_lease()
    with pytest.raises(Unavailable, match="cannot prove its lease"):
        open_gate.require_free(nobody, "s")
    open_gate.lease_renewed(time.monotonic(), 10.0, 1.0)
    open_gate.mark_lost(["s"], "node n1 re-registered")
    with pytest.raises(SequenceLost, match="re-registered"):
        open_gate.require_free(nobody, "s")
    token = _gate("token")
    with pytest.raises(Unauthenticated, match="bearer token"):
        token.require_free(token.from_metadata(()), "s")
