"""Above shortlist.WEIGH_ALL candidates the open script weighs only the prompt's holders, the
in-flight marker's node and the shortlist (coordinator/shortlist.py), and still chooses as
placement.place over every candidate.

Hypothesis draws 17-60 live nodes, a few holding some of the prompt (some on the host tier),
loads, recent opens, room, weights, scans and a marker; RedisStore.open_sequence (real
redis-server) must give place()'s node, cached / new / pending / host blocks and scan flag,
and every score it reports must be place()'s score for that node.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.placement import NodeCandidate, PlacementWeights, place
from pagedkv.coordinator.records import NewSequence, NodeRoom
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.shortlist import WEIGH_ALL, shortlist
from pagedkv.coordinator.store import Store
from pagedkv.protos.errors import CapacityExceeded

SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32", "block_size": 4}
BLOCK = 4
MAX_KEYS = 10
KEYS = [i.to_bytes(16, "big") for i in range(1, MAX_KEYS + 1)]


@st.composite
def clusters(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(WEIGH_ALL + 1, 60))
    holders = set(draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True)))
    nodes = []
    for i in range(n):
        total = draw(st.sampled_from([8, 12, 16]))
        free = draw(st.integers(0, total))
        cached = draw(st.integers(1, MAX_KEYS)) if i in holders else 0
        host_from = draw(st.integers(0, cached))
        nodes.append(
            {
                "id": f"node-{i:03d}",
                "total": total,
                "free": free,
                "evictable": draw(st.integers(0, total - free)),
                "opens": draw(st.sampled_from([0.0, 1.0, 2.5]) | st.floats(0, 6, allow_nan=False)),
                "active": draw(st.none() | st.sampled_from([0, 0, 4, 8])),
                "cached": cached,
                "host_from": host_from,
            }
        )
    slack = st.sampled_from([0.0, 0.05, 0.5, math.inf])
    return {
        "nodes": nodes,
        "num_keys": draw(st.integers(0, MAX_KEYS)),
        "num_blocks": draw(st.integers(1, 12)),
        "weights": PlacementWeights(
            1.0,
            draw(st.sampled_from([0.0, 0.1, 1.0])),
            draw(slack),
            draw(st.sampled_from([0.0, 0.5, 2.0])),
            draw(st.sampled_from([0.0, 1.0, 4.0])),
            0.25,
        ),
        "scan_classes": draw(st.sampled_from([0, 0b11110, 1 << 6])),
        "marker": draw(st.none() | st.tuples(st.integers(0, n - 1), st.integers(2, MAX_KEYS))),
        "scale": draw(st.sampled_from([1.0, 3.5, 2.0**40])),  # the coordinator's scaled counts
    }


def expected(sc: dict[str, Any]) -> Any:
    candidates = []
    for n in sc["nodes"]:
        held = min(n["cached"], sc["num_keys"])
        device = min(n["host_from"], held)
        pending = 0
        if sc["marker"] is not None and sc["nodes"][sc["marker"][0]] is n and held == 0 < sc["num_keys"]:
            pending = min(sc["marker"][1], sc["num_keys"])
        candidates.append(
            NodeCandidate(
                n["id"],
                held,
                n["free"],
                n["total"],
                n["evictable"],
                pending,
                n["opens"] * sc["scale"] / sc["scale"],
                n["active"],
                held - device,
            )
        )
    tie = KEYS[0] if sc["num_keys"] else b""
    try:
        return place(candidates, sc["num_blocks"], BLOCK, sc["weights"], tie, sc["scan_classes"])
    except CapacityExceeded as e:
        return ("CapacityExceeded", e.requested, e.available)


@pytest.fixture
def redis_store(redis_url: str):  # type: ignore[no-untyped-def]
    s = RedisStore(redis_url, prefix="short:")
    yield s
    s.close()


def build(store: Store, sc: dict[str, Any]) -> NewSequence:
    for n in sc["nodes"]:
        store.register_node(n["id"], f"{n['id']}:1", SPEC, n["total"], 30.0)
        if n["cached"]:
            on_host = KEYS[n["host_from"] : n["cached"]]
            store.apply_events(n["id"], KEYS[: n["host_from"]], [], on_host)
    if sc["marker"] is not None and sc["num_keys"]:
        owner = sc["nodes"][sc["marker"][0]]["id"]
        assert isinstance(store, RedisStore)
        store._redis.set(b"short:pend:" + KEYS[0], f"{sc['marker'][1]}:{owner}".encode(), px=30_000)
    rooms = tuple(
        NodeRoom(n["id"], n["free"], n["total"], n["evictable"], n["opens"] * sc["scale"], n["active"])
        for n in sc["nodes"]
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
        pending_ttl_ms=0,
        scan_classes=sc["scan_classes"],
        opens_scale=sc["scale"],
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=clusters())
def test_shortlisted_open_chooses_as_place_over_all(redis_store: RedisStore, sc: dict[str, Any]) -> None:
    redis_store._redis.flushdb()
    want = expected(sc)
    new = build(redis_store, sc)
    try:
        got = redis_store.open_sequence(new)
    except CapacityExceeded as e:
        # Only the nodes weighed are counted in the error's numbers: the kind must agree.
        assert isinstance(want, tuple), (want, e)
        return
    assert not isinstance(want, tuple), (got, want)
    fields = ("node_id", "cached_blocks", "new_blocks", "pending_blocks", "host_blocks", "is_scan")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.node_id in got.scores
    for node_id, score in got.scores.items():
        assert want.scores[node_id] == score
    assert set(got.rejected) <= set(want.rejected)


def test_the_script_weighs_few_rows_of_a_large_table(redis_store: RedisStore) -> None:
    """1,000 candidates: the reply scores the shortlist and the holder, not every node."""
    nodes = [f"n{i:04d}" for i in range(1000)]
    for node_id in nodes:
        redis_store.register_node(node_id, f"{node_id}:1", SPEC, 64, 30.0)
    redis_store.apply_events("n0500", KEYS[:6], [])
    rooms = tuple(NodeRoom(n, 64, 64, 0, 0.0, 0) for n in nodes)
    new = NewSequence("s1", "acme", 40, 10, BLOCK, b"".join(KEYS[:6]), rooms, pending_ttl_ms=0)
    placement = redis_store.open_sequence(new)
    assert (placement.node_id, placement.cached_blocks) == ("n0500", 6)
    short = shortlist(rooms, 10, new.weights, KEYS[0], 0)
    assert set(placement.scores) == set(short.ids) | {"n0500"}
    assert len(placement.scores) <= 9
    # The same open on the embedded store (place() over all 1,000) picks the same node.
    memory = MemoryStore()
    for node_id in nodes:
        memory.register_node(node_id, f"{node_id}:1", SPEC, 64, 30.0)
    memory.apply_events("n0500", KEYS[:6], [])
    assert memory.open_sequence(new).node_id == "n0500"


def test_a_lost_room_table_is_sent_again_whole(redis_store: RedisStore) -> None:
    """The table lives in Redis between opens: when it is gone (a restart, its expiry) the
    script refuses the changed rows alone and the store sends every row once more."""
    nodes = [f"n{i:02d}" for i in range(40)]
    for node_id in nodes:
        redis_store.register_node(node_id, f"{node_id}:1", SPEC, 64, 30.0)
    redis_store.apply_events("n07", KEYS[:4], [])
    rooms = tuple(NodeRoom(n, 64, 64, 0, 0.0, 0) for n in nodes)

    def open_(seq_id: str, rows: tuple[NodeRoom, ...]) -> str:
        new = NewSequence(seq_id, "acme", 40, 10, BLOCK, b"".join(KEYS[:4]), rows, pending_ttl_ms=0)
        return redis_store.open_sequence(new).node_id

    assert open_("s1", rooms) == "n07"
    tables = list(redis_store._redis.scan_iter(b"short:rooms:*"))
    assert len(tables) == 1 and redis_store._redis.hlen(tables[0]) == 40
    redis_store._redis.delete(tables[0])
    # n07 is now busy in the caller's view: only its row changed, but the table is gone.
    busy = tuple(r._replace(active_blocks=500) if r.node_id == "n07" else r for r in rooms)
    assert open_("s2", busy) != "n07"
    assert redis_store._redis.hlen(tables[0]) == 40
    assert open_("s3", rooms) == "n07"  # and a later change travels alone again
