"""The Lua port of placement.place (RedisStore.open_sequence) chooses exactly as place().

Hypothesis draws candidate sets -- cached prefixes, free and total blocks, weights,
the need, a quota, nodes that are not live -- and the same open runs three ways:
placement.place on the live candidates (the specification), MemoryStore.open_sequence
and RedisStore.open_sequence on a real redis-server. All three must agree: the same
Placement (node, cached blocks, new blocks, every score to the bit, rejected nodes) or
the same error with the same numbers, and on success the same page table.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.placement import NodeCandidate, PlacementWeights, place
from pagedkv.coordinator.records import Extent, NewSequence, NodeRoom, SequenceExists, SequenceRecord
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.store import Store
from pagedkv.protos.errors import CapacityExceeded, PagedKVError, QuotaExceeded, Unavailable

SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32", "block_size": 4}
BLOCK = 4
MAX_KEYS = 12
KEYS = [i.to_bytes(16, "big") for i in range(1, MAX_KEYS + 1)]

# Node ids whose byte order, length order and case order disagree (and one not ASCII): ties must
# go to the same rendezvous rank (sha1 of the first key and the id's UTF-8) in Lua as in Python.
NODE_IDS = ["n1", "n2", "n10", "N3", "a", "b-0", "\u00e9t\u00e9", "z"]


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    ids = draw(st.lists(st.sampled_from(NODE_IDS), min_size=0, max_size=5, unique=True))
    nodes = []
    for node_id in ids:
        total = draw(st.integers(0, 12))
        free = draw(st.integers(0, total))
        cached = draw(st.integers(0, MAX_KEYS))
        host_from = draw(st.integers(0, cached))  # keys [host_from, host_to) on its host tier,
        host_to = draw(st.integers(host_from, cached))  # the rest of [0, cached) on its device
        nodes.append(
            {
                "id": node_id,
                "total": total,
                "free": free,
                "evictable": draw(st.integers(0, total - free)),
                "opens": draw(st.sampled_from([0.0, 1.0, 3.0]) | st.floats(0, 20, allow_nan=False)),
                "cached": cached,
                "host": (host_from, host_to),
                "active": draw(st.none() | st.integers(0, 20)),
                "live": draw(st.booleans() | st.just(True)),
            }
        )
    weight = st.sampled_from([0, 1, 1.0, 8.0, 0.5]) | st.floats(0, 50, allow_nan=False)
    slack = st.sampled_from([0.0, 0.1, 0.5, math.inf]) | st.floats(0, 3, allow_nan=False)
    affinity = st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0, 2, allow_nan=False)
    margin = st.sampled_from([0.0, 1.0, 4.0]) | st.floats(0, 8, allow_nan=False)
    marker = st.none() | st.tuples(
        st.sampled_from(NODE_IDS), st.integers(0, MAX_KEYS - 1), st.integers(0, 14)
    )
    return {
        "nodes": nodes,
        "marker": draw(marker),  # an open in flight: (its node, the key it marks, its key count)
        "num_keys": draw(st.integers(0, MAX_KEYS)),
        "num_blocks": draw(st.integers(0, 14)),
        "weights": PlacementWeights(
            draw(weight), draw(weight), draw(slack), draw(affinity), draw(margin), draw(weight)
        ),
        "scan_classes": draw(st.sampled_from([0, 1 << 3, 0b11110]) | st.integers(0, 1 << 6)),
        "quota": draw(st.none() | st.integers(0, 20)),
        "used": draw(st.integers(0, 10)),
        "taken": draw(st.booleans()),  # the seq id already exists
    }


def expected(sc: dict[str, Any]) -> tuple[str, Any]:
    """What the specification says: ("ok", Placement) or (error class name, its numbers)."""
    live = sorted((n for n in sc["nodes"] if n["live"]), key=lambda n: n["id"])
    candidates = []
    for n in live:
        # As the node serves its keys: the device run, then the host run that continues it.
        held = min(n["cached"], sc["num_keys"])
        host_from, host_to = n["host"]
        device = min(host_from, held) if host_to > host_from else held
        held = min(held, host_to) if host_to > host_from else held
        pending, marker = 0, sc["marker"]
        if marker is not None and marker[0] == n["id"] and marker[1] == held < sc["num_keys"]:
            pending = max(0, min(marker[2], sc["num_keys"]) - held)
        candidates.append(
            NodeCandidate(
                n["id"],
                held,
                n["free"],
                n["total"],
                n["evictable"],
                pending,
                n["opens"],
                n["active"],
                held - device,
            )
        )
    try:
        placement = place(
            candidates,
            sc["num_blocks"],
            BLOCK,
            sc["weights"],
            KEYS[0] if sc["num_keys"] else b"",
            sc["scan_classes"],
        )
    except Unavailable:
        return "Unavailable", None
    except CapacityExceeded as e:
        return "CapacityExceeded", (e.requested, e.available, str(e))
    quota = sc["quota"]
    if quota is not None and sc["used"] + sc["num_blocks"] > quota:
        return "QuotaExceeded", (sc["num_blocks"], quota, sc["used"])
    if sc["taken"]:
        return "SequenceExists", None
    return "ok", placement


def outcome(store: Store, new: NewSequence) -> tuple[str, Any]:
    try:
        return "ok", store.open_sequence(new)
    except CapacityExceeded as e:
        return "CapacityExceeded", (e.requested, e.available, str(e))
    except QuotaExceeded as e:
        return "QuotaExceeded", (e.requested, e.quota, e.used)
    except (Unavailable, SequenceExists) as e:
        return type(e).__name__, None


def build(store: Store, sc: dict[str, Any]) -> NewSequence:
    for n in sc["nodes"]:
        if n["live"]:  # a candidate that is not live was never registered
            store.register_node(n["id"], f"{n['id']}:1", SPEC, n["total"], 30.0)
            if n["cached"]:
                host_from, host_to = n["host"]
                on_host = KEYS[host_from:host_to]
                device = [k for k in KEYS[: n["cached"]] if k not in on_host]
                store.apply_events(n["id"], device, [], on_host)
    if sc["used"]:
        store.reserve_blocks("acme", sc["used"], sc["used"])
    if sc["taken"]:
        store.register_node("old", "old:1", SPEC, 1, 30.0)
        store.create_sequence(SequenceRecord("s1", "acme", (Extent("old", 0, 1),)))
    if sc["marker"] is not None:  # what an earlier open leaves (placement.py's in-flight marker)
        node_id, index, count = sc["marker"]
        if isinstance(store, MemoryStore):
            store._pending[KEYS[index]] = (node_id, count, time.monotonic() + 30)
        else:
            assert isinstance(store, RedisStore)
            store._redis.set(b"port:pend:" + KEYS[index], f"{count}:{node_id}".encode(), px=30_000)
    rooms = tuple(
        NodeRoom(n["id"], n["free"], n["total"], n["evictable"], n["opens"], n["active"])
        for n in reversed(sc["nodes"])
    )
    return NewSequence(
        "s1",
        "acme",
        3 * sc["num_blocks"],
        sc["num_blocks"],
        BLOCK,
        b"".join(KEYS[: sc["num_keys"]]),
        rooms,
        sc["weights"],
        sc["quota"],
        pending_ttl_ms=0,
        scan_classes=sc["scan_classes"],
    )


def state(store: Store) -> tuple[Any, ...]:
    """What an open may change: the page table, its node links, the tenant's usage."""
    try:
        record: Any = store.get_sequence("s1")
    except PagedKVError:
        record = None
    links = {n: [r.seq_id for r in store.sequences_of_node(n)] for n in NODE_IDS + ["old"]}
    return record, links, store.tenant_usage("acme")


@pytest.fixture
def redis_store(redis_url: str):  # type: ignore[no-untyped-def]
    s = RedisStore(redis_url, prefix="port:")
    yield s
    s.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_lua_placement_matches_place(redis_store: RedisStore, sc: dict[str, Any]) -> None:
    redis_store._redis.flushdb()
    want = expected(sc)
    for store in (MemoryStore(), redis_store):
        new = build(store, sc)
        before = state(store)
        got = outcome(store, new)
        assert got == want, (type(store).__name__, sc)
        after = state(store)
        if want[0] == "ok":
            node = want[1].node_id
            assert after[0].extents == (Extent(node, 0, sc["num_blocks"]),)
            assert (after[0].tenant, after[0].num_tokens) == ("acme", 3 * sc["num_blocks"])
            assert after[0].state == "active"
            assert after[1][node] == ["s1"]
            quota_used = sc["num_blocks"] if sc["quota"] is not None else 0
            assert after[2] == sc["used"] + quota_used
        else:
            assert after == before, "a refused open changed nothing"
