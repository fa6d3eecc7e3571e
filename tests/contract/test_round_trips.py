"""Round trips per control call, counted on the wire.

Every request redis-py sends goes through Connection.send_packed_command (a
pipeline sends once), so counting its calls counts round trips. Scripts are
warmed first: the very first EVALSHA against a fresh server costs 3 (EVALSHA,
NOSCRIPT, SCRIPT LOAD, EVALSHA), every later one costs 1.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis.connection

from pagedkv.coordinator.records import EventRun, Extent, NewSequence, NodeRoom, SequenceRecord
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos.errors import SequenceNotFound

SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}


def count_round_trips(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], object]) -> int:
    sent = [0]
    original = redis.connection.Connection.send_packed_command

    def counting(self, command, check_health=True):  # type: ignore[no-untyped-def]
        sent[0] += 1
        return original(self, command, check_health)

    with monkeypatch.context() as m:
        m.setattr(redis.connection.Connection, "send_packed_command", counting)
        fn()
    return sent[0]


@pytest.fixture
def store(redis_url: str):  # type: ignore[no-untyped-def]
    s = RedisStore(redis_url)
    s.register_node("n0", "a:0", SPEC, 100, 30.0)  # warm the pool and the scripts used below
    s.apply_events("n0", [bytes(16)], [])
    s.match_prefix([bytes(16)])
    s.create_sequence(SequenceRecord("warm", "t", (Extent("n0", 0, 1),)))
    yield s
    s.close()


def test_open_costs_one_round_trip(store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Coordinator.open: match, placement, quota and page table are one script."""
    keys = [i.to_bytes(16, "big") for i in range(64)]
    store.register_node("n1", "a:1", SPEC, 100, 30.0)
    store.apply_events("n1", keys[:40], [])
    rooms = (NodeRoom("n0", 100, 100), NodeRoom("n1", 50, 100))
    new = NewSequence("s1", "t", 64 * 16, 65, 16, b"".join(keys), rooms, quota=1000)
    store.open_sequence(NewSequence("warm2", "t", 1, 1, 16, b"", rooms))  # loads the script

    placement = None

    def open_sequence() -> None:
        nonlocal placement
        placement = store.open_sequence(new)

    assert count_round_trips(monkeypatch, open_sequence) == 1
    assert placement is not None and (placement.node_id, placement.cached_blocks) == ("n1", 40)
    assert store.get_sequence("s1").extents == (Extent("n1", 0, 65),)
    assert store.tenant_usage("t") == 65


def test_close_costs_one_round_trip(store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Coordinator.close: the tenant check is inside the delete script (no get first)."""
    store.register_node("n1", "a:1", SPEC, 100, 30.0)
    store.create_sequence(SequenceRecord("s1", "t", (Extent("n1", 0, 4),)))
    with pytest.raises(SequenceNotFound):  # loads the script (EVALSHA's first NOSCRIPT)
        store.delete_sequence("absent", tenant="t")
    assert count_round_trips(monkeypatch, lambda: store.delete_sequence("s1", tenant="t")) == 1
    assert store.sequences_of_node("n1") == []


def test_every_control_call_is_one_round_trip(store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    k = bytes(16)
    calls: dict[str, Callable[[], object]] = {
        "register_node": lambda: store.register_node("n1", "a:1", SPEC, 100, 30.0),
        "heartbeat": lambda: store.heartbeat("n1", {"free_blocks": 3}, 30.0),
        "live_nodes": store.live_nodes,
        "expired_nodes": store.expired_nodes,
        "apply_events": lambda: store.apply_events("n1", [k], []),
        "match_prefix": lambda: store.match_prefix([k]),
        "nodes_holding": lambda: store.nodes_holding(k),
        "keys_of": lambda: store.keys_of("n1"),
        "create_sequence": lambda: store.create_sequence(SequenceRecord("s", "t", (Extent("n1", 0, 1),))),
        "open_sequence": lambda: store.open_sequence(
            NewSequence("o", "t", 1, 1, 16, k, (NodeRoom("n1", 9, 9),))
        ),
        "get_sequence": lambda: store.get_sequence("s"),
        "update_sequence": lambda: store.update_sequence("s", num_tokens=9),
        "sequences_of_node": lambda: store.sequences_of_node("n1"),
        "delete_sequence": lambda: store.delete_sequence("s"),
        "delete_opened": lambda: store.delete_sequence("o"),
        "tenant_salt": lambda: store.tenant_salt("t"),
        "reserve_blocks": lambda: store.reserve_blocks("t", 1, 10),
        "release_blocks": lambda: store.release_blocks("t", 1),
        "tenant_usage": lambda: store.tenant_usage("t"),
        "remove_node": lambda: store.remove_node("n1"),
        "ping": store.ping,
    }
    for call in calls.values():  # one full cycle (it ends where it started) loads every script
        call()
    measured = {name: count_round_trips(monkeypatch, call) for name, call in calls.items()}
    assert measured == {name: 1 for name in calls}


def test_apply_event_runs_is_one_round_trip_even_split(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every script of every run goes in one pipelined write (KeptScripts.run_many)."""
    for n in ("n1", "n2"):
        store.register_node(n, f"a:{n}", SPEC, 100, 30.0, epoch=7)
    keys = [i.to_bytes(16, "big") for i in range(10_000)]
    store.apply_event_runs([EventRun("n1", 7, 1, 1, keys[:1], [])])  # loads the scripts
    store.applied_seq("n1", 7)
    runs = [
        EventRun("n1", 7, 2, 3, keys[1:3], []),
        EventRun("n2", 7, 1, 1, keys[:1], []),
        EventRun("n1", 7, 4, 9, keys[3:], [keys[0]]),  # 10,000 keys: 3 scripts
    ]
    answers: list[int] = []
    assert count_round_trips(monkeypatch, lambda: answers.extend(store.apply_event_runs(runs))) == 1
    assert answers == [3, 1, 9]
    assert count_round_trips(monkeypatch, lambda: store.applied_seq("n1", 7)) == 1
    assert store.applied_seq("n1", 7) == 9 and len(store.keys_of("n1")) == 9_999


def test_a_turns_opens_and_closes_are_one_round_trip_each(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open_sequences and delete_sequences pipeline their scripts (KeptScripts.run_many)."""
    store.register_node("n1", "a:1", SPEC, 1000, 30.0)
    rooms = (NodeRoom("n1", 900, 1000),)
    news = [NewSequence(f"s{i}", "t", 32, 2, 16, bytes(16) * 2, rooms) for i in range(8)]
    store.open_sequences(news[:2])  # loads the script
    placed: list[object] = []
    assert count_round_trips(monkeypatch, lambda: placed.extend(store.open_sequences(news[2:]))) == 1
    assert [p.node_id for p in placed] == ["n1"] * 6  # type: ignore[attr-defined]
    assert not list(store._redis.scan_iter(match="*batch:*"))  # the batch's hash went with it
    deleted: list[object] = []
    deletes = [(f"s{i}", "t", True) for i in range(8)]
    assert count_round_trips(monkeypatch, lambda: deleted.extend(store.delete_sequences(deletes))) == 1
    assert [r.seq_id for r in deleted] == [f"s{i}" for i in range(8)]  # type: ignore[attr-defined]
    assert store.sequences_of_node("n1") == []
