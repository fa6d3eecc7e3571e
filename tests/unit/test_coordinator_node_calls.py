"""NodeCalls (the node rpcs a coordinator sends without waiting) against a real
in-process cache node on port 0: every call's outcome reaches its callback exactly
once, as the reply or as the domain error prefixed with where it went."""

from __future__ import annotations

import threading
import time

import pytest

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server
from pagedkv.cluster import free_port
from pagedkv.coordinator.node_calls import NodeCalls
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import NotFound, PagedKVError, Unavailable
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def node():
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    calls = NodeCalls(timeout_s=5.0)
    yield engine, f"127.0.0.1:{port}", calls
    calls.close()
    server.stop(0)


class Outcomes:
    def __init__(self) -> None:
        self.got: dict[str, list[tuple[object, PagedKVError | None]]] = {}
        self.cv = threading.Condition()

    def done(self, key: str):  # type: ignore[no-untyped-def]
        def record(reply: object, error: PagedKVError | None) -> None:
            with self.cv:
                self.got.setdefault(key, []).append((reply, error))
                self.cv.notify_all()

        return record

    def wait(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.got) >= n, timeout=20), self.got


def test_open_and_free_reach_the_node_and_report_their_replies(node) -> None:
    engine, address, calls = node
    out = Outcomes()
    calls.send(address, "Open", pb.OpenRequest(seq_id="s1", token_ids=list(range(8))), "n1", out.done("open"))
    out.wait(1)
    ((reply, error),) = out.got["open"]
    assert error is None and reply.num_cached_tokens == 0
    assert engine.sequence_length("s1") == 0  # opened on the node, nothing appended yet
    calls.send(address, "Free", pb.SeqRequest(seq_id="s1"), "n1", out.done("free"))
    out.wait(2)
    assert out.got["free"][0][1] is None
    with pytest.raises(PagedKVError):
        engine.sequence_length("s1")  # freed


def test_a_node_error_is_the_domain_error_named_by_where(node) -> None:
    _, address, calls = node
    out = Outcomes()
    calls.send(address, "Free", pb.SeqRequest(seq_id="nobody"), "node n1 (x)", out.done("free"))
    out.wait(1)
    ((reply, error),) = out.got["free"]
    assert reply is None and isinstance(error, NotFound) and "node n1 (x)" in str(error)


def test_nothing_listening_is_unavailable_and_a_closed_sender_refuses(node) -> None:
    _, _, calls = node
    out = Outcomes()
    dead = f"127.0.0.1:{free_port()}"
    calls.send(dead, "Free", pb.SeqRequest(seq_id="s"), "node gone", out.done("dead"))
    out.wait(1)
    assert isinstance(out.got["dead"][0][1], Unavailable)
    calls.close()
    calls.send(dead, "Free", pb.SeqRequest(seq_id="s"), "node gone", out.done("closed"))
    ((reply, error),) = out.got["closed"]  # at once, on the caller's thread
    assert reply is None and isinstance(error, Unavailable) and "shutting down" in str(error)


def test_many_concurrent_calls_each_report_once(node) -> None:
    engine, address, calls = node
    out = Outcomes()
    n = 100
    for i in range(n):
        request = pb.OpenRequest(seq_id=f"c{i}", token_ids=[i, i + 1])
        calls.send(address, "Open", request, "n1", out.done(f"c{i}"))
    out.wait(n)
    assert all(len(v) == 1 and v[0][1] is None for v in out.got.values())
    assert all(engine.sequence_length(f"c{i}") == 0 for i in range(n))


def test_held_calls_go_out_when_the_block_ends_however_it_ends(node) -> None:
    engine, address, calls = node
    out = Outcomes()
    with calls.held():
        calls.send(address, "Open", pb.OpenRequest(seq_id="h1", token_ids=[1, 2]), "n1", out.done("h1"))
        with calls.held():  # nested: still held until the outer block ends
            calls.send(address, "Open", pb.OpenRequest(seq_id="h2", token_ids=[1, 2]), "n1", out.done("h2"))
        time.sleep(0.2)
        assert out.got == {}  # nothing sent yet
        with pytest.raises(PagedKVError):
            engine.sequence_length("h1")
    out.wait(2)
    assert engine.sequence_length("h1") == engine.sequence_length("h2") == 0
    with pytest.raises(RuntimeError, match="handler failed"), calls.held():
        calls.send(address, "Free", pb.SeqRequest(seq_id="h1"), "n1", out.done("free"))
        raise RuntimeError("handler failed")
    out.wait(3)  # sent anyway
    assert out.got["free"][0][1] is None
    calls.send(address, "Free", pb.SeqRequest(seq_id="h2"), "n1", out.done("unheld"))
    out.wait(4)  # outside a block: sent at once
    assert out.got["unheld"][0][1] is None
