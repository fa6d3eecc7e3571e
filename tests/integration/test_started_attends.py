"""Attends started on several nodes at once (NodeData.start_attend / start_attend_prefill:
the request sent now, the reply read later), as a sharded decode step makes them, over
every transport: the same-host shared region, the bulk TCP socket, gRPC (futures).

Real node servers on port 0; results are compared with the blocking calls on twin
sequences and with float64 dense attention; errors must be the blocking call's, in the
worker's ids, and leave the connection usable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from conftest import Node
from kvref import SPEC, dense, rand_kv, rand_q

from pagedkv.client import CacheClient, ClientConfig, shm
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound

GRPC = ClientConfig(bulk_min_bytes=None)


@pytest.fixture(params=["shm", "tcp", "grpc"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "tcp":
        monkeypatch.setattr(shm, "is_supported", lambda: False)
    return str(request.param)


def client_for(node: Node, transport: str) -> CacheClient:
    return CacheClient(node.address, GRPC if transport == "grpc" else ClientConfig())


def fill(node: Node, seq_id: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = rand_kv(n, seed)
    tokens = list(range(seed * 1000, seed * 1000 + n))  # no prefix shared between sequences
    node.engine.open(seq_id, tokens)
    node.engine.append(seq_id, tokens, k, v)
    return k, v


def wait_for(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_both_nodes_work_before_either_reply_is_read(make_node: Callable[..., Node], transport: str) -> None:
    """Each node appends the new token and attends once its request is in: both have
    appended before the first reply is read, and the replies equal float64 attention."""
    nodes = [make_node(), make_node()]
    kvs = [fill(node, "s", n, seed=i + 1) for i, (node, n) in enumerate(zip(nodes, (7, 12), strict=True))]
    clients = [client_for(node, transport) for node in nodes]
    try:
        q = rand_q(1, seed=5)
        new_k, new_v = rand_kv(1, seed=6)
        replies = [c.data.start_attend(["s"], 0, q, new_k[0], new_v[0], [77]) for c in clients]
        for node, (k, _) in zip(nodes, kvs, strict=True):
            wait_for(lambda node=node, n=k.shape[1]: node.engine.sequence_length("s") == n + 1, "appended")
        if transport != "grpc":  # neither reply read yet: both nodes had their request at once
            assert [c.data.bulk.num_calls for c in clients if c.data.bulk is not None] == [0, 0]
        results = [r.result() for r in replies]
        for res, (k, v) in zip(results, kvs, strict=True):
            keys = torch.cat([k[0], new_k[0]])
            values = torch.cat([v[0], new_v[0]])
            out, lse = dense(q, keys, values)
            torch.testing.assert_close(res.out.double(), out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(res.lse.double(), lse, rtol=1e-5, atol=1e-5)
        # the same calls blocking give the same answers (bitwise: the same kernels)
        again = [c.data.start_attend(["s"], 1, q) for c in clients]
        blocking = [c.data.attend(["s"], 1, q) for c in clients]
        for started, res in zip(again, blocking, strict=True):
            got = started.result()
            assert torch.equal(got.out, res.out) and torch.equal(got.lse, res.lse)
        bulk = clients[0].data.bulk
        if transport != "grpc":
            assert bulk is not None and bulk.num_calls == 3
            assert bulk.num_local_calls == (3 if transport == "shm" else 0)
    finally:
        for c in clients:
            c.close()
    for node in nodes:
        node.engine.check_integrity()


def test_a_started_call_fails_as_the_blocking_call_does(
    make_node: Callable[..., Node], transport: str
) -> None:
    node = make_node()
    fill(node, "s", 5, seed=1)
    with client_for(node, transport) as client:
        q = rand_q(1, seed=2)
        with pytest.raises(InvalidArgument, match="sequence ids must be str"):
            client.data.start_attend([7], 0, q)  # type: ignore[list-item]  (refused before sending)
        reply = client.data.start_attend(["nobody"], 0, q)
        with pytest.raises(SequenceNotFound) as refused:
            reply.result()
        assert refused.value.seq_id == "nobody"
        wrong_layer = client.data.start_attend(["s"], 9, q)
        with pytest.raises(InvalidArgument, match="layer"):
            wrong_layer.result()
        # the connection stayed in sync: the next call on it answers
        res = client.data.start_attend(["s"], 0, q).result()
        k, v = rand_kv(5, 1)
        torch.testing.assert_close(res.out.double(), dense(q, k[0], v[0])[0], rtol=1e-5, atol=1e-5)
        if transport != "grpc":
            bulk = client.data.bulk
            assert bulk is not None and bulk.num_idle("tcp" if transport == "tcp" else "unix") == 1
            started = client.data.start_attend(["s"], 0, q)
            started.result()
            with pytest.raises(RuntimeError, match="read once"):
                started.result()
    assert node.engine.sequence_length("s") == 5
    node.engine.check_integrity()


def test_started_prefill_matches_the_blocking_one(make_node: Callable[..., Node], transport: str) -> None:
    """start_attend_prefill (gRPC whatever the transport: AttendPrefill has no bulk op):
    queries past the node's tokens (an earlier extent's view) and its errors."""
    node = make_node()
    k, v = fill(node, "s", 9, seed=3)
    with client_for(node, transport) as client:
        q = rand_q(3, seed=4)
        started = client.data.start_attend_prefill("s", 1, q, query_position=20)
        blocking = client.data.attend_prefill("s", 1, q, query_position=20)
        got = started.result()
        assert torch.equal(got.out, blocking.out) and torch.equal(got.lse, blocking.lse)
        out, lse = dense(q, k[1], v[1])
        torch.testing.assert_close(got.out.double(), out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.lse.double(), lse, rtol=1e-5, atol=1e-5)
        with pytest.raises(SequenceNotFound) as refused:
            client.data.start_attend_prefill("gone", 1, q, query_position=20).result()
        assert refused.value.seq_id == "gone"
    assert SPEC.num_layers == 2 and node.engine.sequence_length("s") == 9
