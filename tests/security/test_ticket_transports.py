"""The ticket check cannot be skipped on any transport: gRPC, the bulk TCP port (TLS),
the same-host Unix socket and shared memory, each tried with no ticket, the
attacker's own ticket for another sequence, a ticket for another node, an expired
one, one of an earlier registration of the node, and a forged MAC -- all against
the victim's sequence, through the client library forced onto that one transport
(its counters prove the transport carried the call, not the gRPC fallback)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from hostile import Q_HEADS, SPEC, Secured, kv

from pagedkv.client import CacheClient
from pagedkv.protos.errors import PermissionDenied, SequenceLost, Unauthenticated
from pagedkv.protos.tickets import ClusterKeys, Ticket, issue, parse

TRANSPORTS = {
    "grpc": ("grpc",),
    "tcp": ("tcp", "grpc"),
    "unix": ("unix", "grpc"),
    "shm": ("shm", "grpc"),
}
FORGER = ClusterKeys([b"a key the attacker made up ......................"])


def _bad_tickets(cluster: Secured) -> dict[str, tuple[bytes, type, str]]:
    """kind -> (ticket, the error class, a piece of its message)."""
    v = cluster.victim
    assert v is not None
    real = parse(v.ticket)
    beta = cluster.clients["beta"]
    other_node = next(a for a in cluster.node_addresses() if a != v.address)
    own = _on(beta, v.address, "mine")
    elsewhere = _on(cluster.clients["alpha"], other_node, "elsewhere")
    past = int(time.time()) - 60
    out = {
        "none": (b"", Unauthenticated, "none presented"),
        "another sequence's": (own.route.ticket, PermissionDenied, "no ticket for sequence"),
        "another node's": (elsewhere.route.ticket, Unauthenticated, "presented to node"),
        "expired": (issue(cluster.keys, real._replace(expires_at=past)), Unauthenticated, "expired"),
        "an earlier registration's": (
            issue(cluster.keys, real._replace(epoch=real.epoch ^ 1)),
            SequenceLost,
            "earlier registration",
        ),
        "forged": (issue(FORGER, real), Unauthenticated, "not signed by this cluster's key"),
    }
    cluster.clients["_cleanup"] = [own, elsewhere]  # type: ignore[assignment]
    return out


def _on(client: CacheClient, address: str, name: str) -> Any:
    for i in range(20):
        seq = client.open(f"{name}-{i}", [9_000 + i, 5, 6])
        if seq.route.address == address:
            seq.append([9_000 + i, 5, 6], *kv([1, 2, 3], seed=i))
            return seq
        seq.close()
    raise AssertionError(f"nothing landed on {address}")


@pytest.fixture(scope="module")
def bad(secured: Secured) -> Any:
    tickets = _bad_tickets(secured)
    yield tickets
    for seq in secured.clients.pop("_cleanup"):  # type: ignore[union-attr]
        seq.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "kind",
    ["none", "another sequence's", "another node's", "expired", "an earlier registration's", "forged"],
)
def test_every_transport_refuses_a_call_without_a_valid_ticket(
    cluster: Secured, bad: Any, transport: str, kind: str
) -> None:
    v = cluster.victim
    assert v is not None
    ticket, error, message = bad[kind]
    attacker = cluster.client("beta", transports=TRANSPORTS[transport], bulk_min_bytes=0)
    try:
        node = attacker.node(v.address)
        node.wallet.add("v", v.node_seq_id, ticket)  # the victim's id, presented with this ticket
        link = node.data.bulk
        q = torch.zeros(1, Q_HEADS, SPEC.head_dim)
        one = torch.full((1, SPEC.num_kv_heads, SPEC.head_dim), 1e4)
        calls = {
            "read_kv": lambda: node.data.read_kv("v", 0, 16),
            "attend": lambda: node.data.attend(["v"], 0, q),
            "attend+append": lambda: node.data.attend(["v"], 0, q, one, one, [7]),
        }
        if transport != "shm":  # (appends take the Unix socket on that path)
            k, vv = kv([7], seed=1)
            calls["append"] = lambda: node.data.append("v", [7], k + 1e4, vv)
        for name, call in calls.items():
            before = _counts(link)
            with pytest.raises(error, match=message):
                call()
            after = _counts(link)
            if transport != "grpc":  # the bulk path carried it and the node answered the refusal
                assert after["refused"] == before["refused"] + 1, (name, before, after)
            if transport == "shm" and name.startswith("attend"):  # the region's call, or its AUTH refused
                assert after["shm_calls"] + after["auth"] == before["shm_calls"] + before["auth"] + 1, (
                    name,
                    after,
                )
            if transport == "unix":
                assert link is not None and link.num_idle("unix") >= 1
    finally:
        attacker.close()


def _counts(link: Any) -> dict[str, int]:
    if link is None:
        return {"refused": 0, "shm_calls": 0, "auth": 0}
    return {"refused": link.num_refused, "shm_calls": link.num_local_calls, "auth": link.num_auth}


def test_a_valid_ticket_works_on_every_transport(cluster: Secured) -> None:
    """The control: the owner's own ticket carries every call on every transport."""
    v = cluster.victim
    assert v is not None
    for name, transports in TRANSPORTS.items():
        owner = cluster.client("alpha", transports=transports, bulk_min_bytes=0)
        try:
            seq = owner.sequence("victim")
            k, _ = seq.read_kv()
            assert torch.equal(k, v.k), name
            seq.attend(0, torch.zeros(Q_HEADS, SPEC.head_dim))
            link = owner.node(v.address).data.bulk
            if name != "grpc":
                assert link is not None and link.num_auth >= 1, name  # presented once on the connection
        finally:
            owner.close()


def test_tickets_name_every_field_they_bind(cluster: Secured) -> None:
    v = cluster.victim
    assert v is not None
    t = parse(v.ticket)
    assert (t.tenant, t.seq_id, t.node_id) == ("alpha", "alpha/victim", v.seq.route.node_id)
    assert t.epoch != 0 and t.expires_at > time.time() + 3600
    assert dataclasses.is_dataclass(Ticket) is False and t.rights == 3
