"""Redis goes away and comes back: the same RedisStore object recovers.

While redis-server is stopped every call raises Unavailable (never a raw redis
exception), quickly: the port refuses connections and the socket timeouts are
bounded. After a restart on the same port the same store works again, including
its Lua scripts (the new server has no script cache: redis-py's Script reloads on
NOSCRIPT). The test server runs without persistence (--save '' --appendonly no),
so data written before the outage is gone; production Redis should persist
(AOF) — what survives a real restart is Redis's configuration, not this code's.
"""

from __future__ import annotations

import socket
import time

import pytest

from pagedkv.coordinator.records import Extent, NewSequence, NodeRoom, SequenceRecord
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos.errors import Unavailable

pytestmark = pytest.mark.timeout(60)

SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}
KEY = bytes(16)


def calls(store: RedisStore) -> dict[str, object]:
    """One call of every kind the coordinator makes (scripts and plain commands)."""
    return {
        "ping": store.ping,
        "register_node": lambda: store.register_node("n1", "a:1", SPEC, 10, 30.0),
        "heartbeat": lambda: store.heartbeat("n1", {"free_blocks": 1}, 30.0),
        "live_nodes": store.live_nodes,
        "expired_nodes": store.expired_nodes,
        "apply_events": lambda: store.apply_events("n1", [KEY], []),
        "match_prefix": lambda: store.match_prefix([KEY]),
        "nodes_holding": lambda: store.nodes_holding(KEY),
        "create_sequence": lambda: store.create_sequence(SequenceRecord("s1", "t", (Extent("n1", 0, 1),))),
        "get_sequence": lambda: store.get_sequence("s1"),
        "open_sequence": lambda: store.open_sequence(
            NewSequence("s2", "t", 4, 1, 4, KEY, (NodeRoom("n1", 10, 10),), quota=5)
        ),
        "tenant_salt": lambda: store.tenant_salt("t"),
        "reserve_blocks": lambda: store.reserve_blocks("t", 1, 10),
        "tenant_usage": lambda: store.tenant_usage("t"),
        "delete_sequence": lambda: store.delete_sequence("s1"),
        "remove_node": lambda: store.remove_node("n1"),
    }


def test_outage_raises_unavailable_fast_then_recovers(redis_server, redis_url: str) -> None:
    store = RedisStore(redis_url)
    for call in calls(store).values():  # warm: pool connected, scripts loaded
        call()  # type: ignore[operator]

    redis_server.stop()
    try:
        for name, call in calls(store).items():
            started = time.monotonic()
            with pytest.raises(Unavailable, match="redis"):
                call()  # type: ignore[operator]
            assert time.monotonic() - started < 2.0, f"{name} took too long to fail"
    finally:
        redis_server.start()

    results = {name: call() for name, call in calls(store).items()}  # type: ignore[operator]
    assert results["heartbeat"] is True
    assert results["match_prefix"] == {"n1": 1}
    assert results["get_sequence"] == SequenceRecord("s1", "t", (Extent("n1", 0, 1),))
    assert results["open_sequence"].node_id == "n1" and results["open_sequence"].cached_blocks == 1  # type: ignore[attr-defined]
    assert results["reserve_blocks"] == 2  # the open reserved 1 block first
    assert results["remove_node"].was_registered is True  # type: ignore[attr-defined]
    store.close()


def test_store_builds_while_redis_is_down_and_fails_per_call() -> None:
    """A coordinator can start before Redis: construction connects lazily."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0")
    started = time.monotonic()
    with pytest.raises(Unavailable, match="match_prefix"):
        store.match_prefix([KEY])
    assert time.monotonic() - started < 2.0
    store.close()


def test_a_frozen_redis_times_out_as_unavailable_within_the_socket_timeout(
    redis_server, redis_url: str
) -> None:
    """A hung Redis (SIGSTOP) answers nothing: the bounded socket timeout turns that into
    Unavailable; timeouts are not retried (the command may have run)."""
    store = RedisStore(redis_url, socket_timeout_s=0.5)
    store.register_node("n1", "a:1", SPEC, 10, 30.0)
    redis_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable, match="heartbeat"):
            store.heartbeat("n1", {}, 30.0)
        assert time.monotonic() - started < 1.5
    finally:
        redis_server.resume()
    assert store.heartbeat("n1", {}, 30.0) is True
    store.close()


def test_a_turns_opens_and_closes_in_an_outage_fail_alone_and_leave_nothing_in_flight(
    redis_server, redis_url: str
) -> None:
    """Coordinator.open_many / close_many (a framed loop's turn, one pipelined round trip):
    with Redis down every call answers Unavailable, none stays in flight (a reopen would
    wait on it), no quota is held; once Redis is back the same calls succeed."""
    from pagedkv.coordinator.core import CloseArgs, Coordinator, CoordinatorConfig, OpenArgs

    coordinator = Coordinator(RedisStore(redis_url), CoordinatorConfig(lease_ttl_s=30, quotas={"t": 100}))
    coordinator.register("n1", "127.0.0.1:1", dict(SPEC, dtype="float32", block_size=4), 1000, 1)
    opens = [OpenArgs("t", list(range(1, 30)), f"s{i}", worker_opens=True) for i in range(4)]
    coordinator.open_many(opens[:1])  # warm: salt, scripts
    coordinator.close_many([CloseArgs("t", "s0", freed_extents=1)])
    try:
        redis_server.stop()
        started = time.monotonic()
        answers = coordinator.open_many(opens) + coordinator.close_many([CloseArgs("t", "s1")] * 2)
        assert time.monotonic() - started < 4.0
        assert [type(a).__name__ for a in answers] == ["Unavailable"] * 6
        assert not any(coordinator.is_in_flight(f"s{i}") for i in range(4))
    finally:
        redis_server.start()
    coordinator.register("n1", "127.0.0.1:1", dict(SPEC, dtype="float32", block_size=4), 1000, 2)  # (no AOF)
    opened = coordinator.open_many(opens)
    assert [o.seq_id for o in opened] == ["s0", "s1", "s2", "s3"]  # type: ignore[union-attr]
    assert coordinator.store.tenant_usage("t") == 4 * 8
    assert coordinator.close_many([CloseArgs("t", f"s{i}", freed_extents=1) for i in range(4)]) == [None] * 4
    assert coordinator.store.tenant_usage("t") == 0 and coordinator.store.sequences_of_node("n1") == []
    coordinator.stop()
