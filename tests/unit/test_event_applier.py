"""Numbered block events from a node's outbox (cache_node/event_outbox.py) through two
coordinator replicas' appliers (coordinator/event_applier.py) into one embedded store:
whatever the interleaving of reports, lost replies, flushes and replica crashes, once the
node's outbox is empty the store's index equals the node's whole event log replayed in
order. Real parts: MemoryStore, the outbox and the applier, no threads (flushes are
actions)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cache_node.event_outbox import EventOutbox
from pagedkv.coordinator.event_applier import OFFLOADED_KIND, STORED_KIND, EventApplier
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.protos.errors import InvalidArgument, NodeNotLive
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4).to_dict()
KEYS = [bytes([i]) * 16 for i in range(12)]  # few keys: each is stored and removed many times
REMOVED_KIND = 2
EPOCH = 7


def registered() -> MemoryStore:
    store = MemoryStore()
    store.register_node("n", "127.0.0.1:1", SPEC, 64, 60.0, EPOCH)
    return store


def held(log: list[tuple[int, bytes]]) -> set[bytes]:
    """The keys a node holds after `log`, replayed in order (device or host)."""
    last: dict[bytes, int] = {}
    for kind, key in log:
        last[key] = kind
    return {k for k, kind in last.items() if kind in (STORED_KIND, OFFLOADED_KIND)}


def report(box: EventOutbox, replica: EventApplier, deliver_reply: bool = True) -> None:
    first, base, events = box.to_send()
    applied, next_seq = replica.offer("n", EPOCH, first, events, base)
    if deliver_reply:
        box.settle(applied, next_seq)


def notify(box: EventOutbox, replica: EventApplier, arrives: bool = True) -> None:
    """A one-way report (no reply): the node counts it sent; it may never arrive."""
    first, base, events = box.to_send()
    if not events:
        return
    if arrives:
        replica.offer("n", EPOCH, first, events, base)
    box.mark_sent()


def beat(box: EventOutbox, replica: EventApplier) -> None:
    """A beat asking how far the events got; its reply settles the outbox."""
    acked = replica.acknowledge("n", EPOCH)
    assert acked is not None  # (the node is live throughout)
    box.settle(*acked)


EVENT = st.tuples(st.sampled_from([STORED_KIND, REMOVED_KIND, OFFLOADED_KIND]), st.integers(0, 11))
ACTION = st.one_of(
    st.tuples(st.just("events"), st.lists(EVENT, max_size=6)),
    st.tuples(st.just("report"), st.integers(0, 1), st.booleans()),
    st.tuples(st.just("notify"), st.integers(0, 1), st.booleans()),
    st.tuples(st.just("beat"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("flush"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("crash"), st.integers(0, 1), st.just(0)),
)


@pytest.mark.parametrize("by_beats", [False, True], ids=["settled by replies", "settled by beats"])
@settings(max_examples=300, deadline=None)
@given(st.lists(ACTION, max_size=40))
def test_any_interleaving_ends_with_the_logs_replay(by_beats: bool, actions) -> None:
    """Reports as calls (their replies delivered or lost), one-way (arriving or lost) and
    beats asking how far they got, to either replica, with flushes and crashes: then
    the node's own loop, two-way or one-way (its beats alone), reaches the replay."""
    store = registered()
    replicas = [EventApplier(store, background=False) for _ in range(2)]
    box = EventOutbox(sync_after_s=0.0)
    log: list[tuple[int, bytes]] = []
    last_applied = 0
    for action in actions:
        if action[0] == "events":
            events = [(kind, KEYS[i]) for kind, i in action[1]]
            log.extend(events)
            box.add(events)
        elif action[0] == "report":
            report(box, replicas[action[1]], deliver_reply=action[2])
        elif action[0] == "notify":
            notify(box, replicas[action[1]], arrives=action[2])
        elif action[0] == "beat":
            beat(box, replicas[action[1]])
        elif action[0] == "flush":
            replicas[action[1]].flush()
        else:  # the replica dies with its queue; a fresh process takes its place
            replicas[action[1]] = EventApplier(store, background=False)
        applied = store.applied_seq("n", EPOCH)
        assert last_applied <= applied <= len(log)  # only forward, never past what happened
        last_applied = applied
    box.is_acked_by_beats = by_beats
    for _ in range(6):  # settle: the node reports until the store holds everything
        if not box.pending and box.sent == box.last:
            break
        if by_beats:  # a beat, the resend it asks for, applied
            beat(box, replicas[0])
            notify(box, replicas[0])
            replicas[0].flush()
            beat(box, replicas[0])
        else:
            report(box, replicas[0])
            replicas[0].flush()
            report(box, replicas[0])
    assert not box.pending and box.sent == box.last, (box.first, box.sent, len(log))
    assert store.applied_seq("n", EPOCH) == len(log)
    assert store.keys_of("n") == held(log)
    for replica in replicas:  # what waits is counted as a flush takes it: nothing is left
        replica.flush()
        assert replica.num_queued == 0


def test_the_outbox_sends_one_way_and_a_beat_settles_or_rewinds_it() -> None:
    store = registered()
    applier = EventApplier(store, background=False)
    box = EventOutbox(sync_after_s=0.0)
    box.is_acked_by_beats = True
    box.add([(STORED_KIND, k) for k in KEYS[:3]])
    notify(box, applier)
    assert (box.sent, box.first) == (3, 1) and not box.is_due()  # sent; no empty report asks
    beat(box, applier)  # queued, not applied: kept
    assert (box.sent, box.first, len(box.pending)) == (3, 1, 3)
    applier.flush()
    beat(box, applier)
    assert (box.sent, box.first, box.pending) == (3, 4, [])
    box.add([(STORED_KIND, KEYS[3]), (REMOVED_KIND, KEYS[0])])
    notify(box, applier)
    restarted = EventApplier(store, background=False)  # 4-5 died with the queue
    assert restarted.acknowledge("n", EPOCH) == (3, 4)  # loaded from the store
    beat(box, restarted)
    assert box.is_due() and box.to_send() == (4, 3, [(STORED_KIND, KEYS[3]), (REMOVED_KIND, KEYS[0])])
    notify(box, restarted)
    restarted.flush()
    beat(box, restarted)
    assert not box.pending and store.keys_of("n") == {KEYS[1], KEYS[2], KEYS[3]}
    assert restarted.acknowledge("n", EPOCH + 2) is None  # not live under another epoch
    with pytest.raises(InvalidArgument, match="events_epoch"):
        restarted.acknowledge("n", 0)


def test_a_gap_is_answered_with_where_to_resend_from() -> None:
    store = registered()
    applier = EventApplier(store, background=False)
    assert applier.offer("n", EPOCH, 1, [(STORED_KIND, KEYS[0])]) == (0, 2)
    assert applier.offer("n", EPOCH, 5, [(STORED_KIND, KEYS[1])]) == (0, 2)  # 2-4 never came
    applier.flush()
    assert store.keys_of("n") == {KEYS[0]} and store.applied_seq("n", EPOCH) == 1
    # a fresh replica starts from the store: a resend of 1-2 skips the 1 the store holds
    fresh = EventApplier(store, background=False)
    assert fresh.offer("n", EPOCH, 1, [(STORED_KIND, KEYS[0]), (STORED_KIND, KEYS[1])]) == (1, 3)
    fresh.flush()
    assert store.keys_of("n") == {KEYS[0], KEYS[1]}


def test_on_applied_gets_each_flushs_whole_runs_only() -> None:
    """A flush hands on_applied the runs the store took, netted (a run the store refused, or
    one past a gap, is not among them): what the coordinator's memory of removals follows."""
    store = registered()
    store.register_node("m", "127.0.0.1:2", SPEC, 64, 60.0, EPOCH)
    seen: list[list] = []
    applier = EventApplier(store, seen.append, background=False)
    applier.offer("n", EPOCH, 1, [(STORED_KIND, KEYS[0]), (REMOVED_KIND, KEYS[1]), (REMOVED_KIND, KEYS[0])])
    applier.offer("m", EPOCH, 1, [(OFFLOADED_KIND, KEYS[2])])
    applier.flush()
    [runs] = seen
    assert [(r.node_id, set(r.stored), set(r.removed), set(r.offloaded)) for r in runs] == [
        ("n", set(), {KEYS[0], KEYS[1]}, set()),
        ("m", set(), set(), {KEYS[2]}),
    ]
    applier.offer("m", EPOCH, 2, [(STORED_KIND, KEYS[3])])
    store.register_node("n", "127.0.0.1:1", SPEC, 64, 60.0, EPOCH + 2)  # n's next run is refused
    applier.offer("n", EPOCH, 4, [(STORED_KIND, KEYS[4])])
    applier.flush()
    assert [(r.node_id, r.stored) for r in seen[1]] == [("m", (KEYS[3],))]
    applier.flush()  # nothing queued: on_applied is not called
    assert len(seen) == 2


def test_a_node_that_forgot_what_the_store_lost_starts_after_it() -> None:
    """A failover lost applied events the node already forgot (base_seq): the next run
    applies past them instead of waiting forever for a resend that cannot come."""
    store = registered()
    applier = EventApplier(store, background=False)
    assert applier.offer("n", EPOCH, 11, [(STORED_KIND, KEYS[2])], base_seq=10) == (10, 12)
    applier.flush()
    assert store.applied_seq("n", EPOCH) == 11 and store.keys_of("n") == {KEYS[2]}


@pytest.mark.parametrize(
    ("first", "base", "events", "match"),
    [
        (0, 0, [], "first_seq"),
        (2**63 - 1, 0, [(1, KEYS[0])] * 2, "first_seq"),
        (3, 3, [], "base_seq"),
        (1, 0, [(1, b"short")], "event 0: a 5-byte key"),
    ],
)
def test_bad_reports_are_refused_by_name_and_change_nothing(first, base, events, match) -> None:
    store = registered()
    applier = EventApplier(store, background=False)
    with pytest.raises(InvalidArgument, match=match):
        applier.offer("n", EPOCH, first, events, base)
    applier.flush()
    assert store.applied_seq("n", EPOCH) == 0 and not store.keys_of("n")


def test_another_registrations_or_a_dead_nodes_events_are_refused() -> None:
    store = registered()
    applier = EventApplier(store, background=False)
    with pytest.raises(NodeNotLive):
        applier.offer("n", EPOCH + 1, 1, [(STORED_KIND, KEYS[0])])
    applier.offer("n", EPOCH, 1, [(STORED_KIND, KEYS[0])])
    store.register_node("n", "127.0.0.1:1", SPEC, 64, 60.0, EPOCH + 2)  # came back: a new epoch
    applier.flush()  # the old registration's run is refused, nothing applied
    assert not store.keys_of("n")
    with pytest.raises(NodeNotLive):
        applier.offer("n", EPOCH, 2, [(REMOVED_KIND, KEYS[0])])
    assert applier.offer("n", EPOCH + 2, 1, [(STORED_KIND, KEYS[3])]) == (0, 2)


def test_a_full_queue_refuses_until_the_store_takes_it() -> None:
    from pagedkv.protos.errors import Unavailable

    store = registered()
    applier = EventApplier(store, background=False, max_queued=2)
    applier.offer("n", EPOCH, 1, [(STORED_KIND, KEYS[0]), (STORED_KIND, KEYS[1])])
    with pytest.raises(Unavailable, match="wait for the store"):
        applier.offer("n", EPOCH, 3, [(STORED_KIND, KEYS[2])])
    applier.flush()
    assert applier.offer("n", EPOCH, 3, [(STORED_KIND, KEYS[2])]) == (2, 4)


def test_the_outbox_keeps_events_until_applied_and_resends_from_next_seq() -> None:
    box = EventOutbox(sync_after_s=3600.0)
    box.add(["e1", "e2", "e3"])
    assert box.to_send() == (1, 0, ["e1", "e2", "e3"]) and box.is_due()
    box.settle(applied=1, next_seq=4)  # all queued, the first applied
    assert (box.first, box.sent, box.pending) == (2, 3, ["e2", "e3"])
    assert not box.is_due()  # sent, and asked about only after sync_after_s
    box.settle(applied=1, next_seq=2)  # a restarted coordinator lacks 2 and 3
    assert box.to_send() == (2, 1, ["e2", "e3"]) and box.is_due()
    box.add(["e4"])
    box.settle(applied=0, next_seq=0)  # an older coordinator applied what it was sent
    assert (box.first, box.sent, box.pending) == (5, 4, [])
    box.restart()
    assert (box.first, box.sent, box.last) == (1, 0, 0)


def test_a_stale_queue_is_dropped_when_the_node_forgot_past_it() -> None:
    """Replica 1 holds events 2-3 unflushed; replica 0 applies 2-4 (a key's last event is 4)
    and the node forgets them. The node's next report to replica 1 says so (base_seq 4):
    replica 1's 2-3 must not be applied over event 4."""
    store = registered()
    r0, r1 = (EventApplier(store, background=False) for _ in range(2))
    box = EventOutbox(sync_after_s=0.0)
    box.add([(STORED_KIND, KEYS[0])])
    report(box, r0)
    r0.flush()
    report(box, r1)  # r1 loads applied 1 from the store
    box.add([(STORED_KIND, KEYS[1]), (STORED_KIND, KEYS[2])])
    report(box, r1, deliver_reply=False)  # r1 queues 2-3; the reply is lost
    box.add([(REMOVED_KIND, KEYS[1])])
    report(box, r0)  # r0 queues 2-4 (it had 1)
    r0.flush()
    report(box, r0)  # the node hears applied 4 and forgets 1-4
    assert box.first == 5
    box.add([(STORED_KIND, KEYS[3])])
    report(box, r1)
    r1.flush()
    assert store.applied_seq("n", EPOCH) == 5
    assert store.keys_of("n") == {KEYS[0], KEYS[2], KEYS[3]}  # KEYS[1] was removed by event 4


def test_a_store_that_lost_applied_events_gets_them_again(redis_url) -> None:
    """Redis came back from an older copy (applied 2 where 5 had been applied and the node
    told so): the coordinator's next run is refused as a gap, it rewinds to the store, and
    the node's resend of 6-7, vouching for the 1-5 it forgot, is applied past them."""
    from redis import Redis

    from pagedkv.coordinator.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        store.register_node("n", "127.0.0.1:1", SPEC, 64, 60.0, EPOCH)
        applier = EventApplier(store, background=False)
        box = EventOutbox(sync_after_s=0.0)
        box.add([(STORED_KIND, k) for k in KEYS[:5]])
        report(box, applier)
        applier.flush()
        assert store.applied_seq("n", EPOCH) == 5
        Redis.from_url(redis_url).hset("pkv:node:n", "applied", 2)  # the older copy
        box.add([(STORED_KIND, KEYS[5]), (STORED_KIND, KEYS[6])])
        report(box, applier)  # 6-7 continue what the coordinator queued; the node forgets 1-5
        applier.flush()  # the store has 2: a gap, refused; the coordinator rewinds
        assert store.applied_seq("n", EPOCH) == 2
        for _ in range(3):  # asked where to resend from, resent (the node vouches for 1-5), applied
            report(box, applier)
            applier.flush()
        report(box, applier)
        assert not box.pending and store.applied_seq("n", EPOCH) == 7
        assert store.keys_of("n") == set(KEYS[:7])
    finally:
        store.close()


def test_a_flush_that_fails_keeps_its_runs_ahead_of_newer_events(redis_server, redis_url) -> None:
    """Redis stops answering mid-stream: the flush fails (its runs kept), newer events of the
    same keys queue behind them, and the next flush applies both in order."""
    from pagedkv.coordinator.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        store.register_node("n", "127.0.0.1:1", SPEC, 64, 60.0, EPOCH)
        applier = EventApplier(store, background=False)
        applier.offer("n", EPOCH, 1, [(STORED_KIND, KEYS[0]), (STORED_KIND, KEYS[1])])
        redis_server.pause()
        try:
            flushed: list[bool] = []
            flush = threading.Thread(target=lambda: flushed.append(applier.flush()))
            flush.start()
            time.sleep(0.2)  # the flush waits on Redis with 1-2 taken
            applier.offer("n", EPOCH, 3, [(REMOVED_KIND, KEYS[0])])  # newer, queued meanwhile
            flush.join(30)
            assert flushed == [False]  # Unavailable after the socket timeout: its runs kept
        finally:
            redis_server.resume()
        assert applier.flush()
        assert store.applied_seq("n", EPOCH) == 3 and store.keys_of("n") == {KEYS[1]}
    finally:
        store.close()
