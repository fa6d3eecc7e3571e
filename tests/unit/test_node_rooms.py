"""The coordinator's candidate rows (coordinator/node_rooms.py) are kept between opens: after
every change a node's row is made of (registration, beat, an open or close counted there, a
node gone, the reaper's refresh, a spec's own set) the snapshot an open takes must equal the
rows built from scratch, so a change that forgot to mark its node would be caught here."""

from __future__ import annotations

import pytest

from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.liveness import Liveness, LivenessConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.records import NodeRoom, spec_view
from pagedkv.protos.errors import InvalidArgument

SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "block_size": 4}
OTHER = {**SPEC, "block_size": 8}


def from_scratch(c: Coordinator, spec: dict | None = None) -> list[NodeRoom]:
    with c._lock:
        ids = sorted(n for n, info in c._nodes.items() if spec is None or info.spec == spec_view(spec))
        return [r for r in (c._room_row(n) for n in ids) if r is not None]


def check(c: Coordinator) -> None:
    assert list(c._candidates(None)) == from_scratch(c)
    assert list(c._candidates(SPEC)) == from_scratch(c, SPEC)


def test_the_kept_rows_follow_every_change() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    c = Coordinator(store, CoordinatorConfig(lease_ttl_s=30, balance_half_life_opens=2.0))
    c.liveness = Liveness(LivenessConfig(30, grace_s=0), lambda _n, _t: None, lambda: now[0])
    c.liveness.store_answered()
    for i in range(6):
        c.register(f"n{i}", f"10.0.0.1:{i}", SPEC if i < 5 else OTHER, 64)
    check(c)
    c.heartbeat("n1", {"free_blocks": 40, "cached_blocks": 10, "used_blocks": 14})
    check(c)
    c._count_open("n2", 5)
    c._account("n2", 5)
    check(c)
    c._account("n2", -5)
    c._release_active("n2", 5)
    c._add_active("n3", 7)
    check(c)
    for _ in range(700):  # the decay's scale passes 1e100 and every count is rescaled
        c._count_open("n4", 1)
    check(c)
    c._node_gone("n3", [], [])
    check(c)
    now[0] = 20.0
    for i in (0, 1, 2, 3, 5):
        c.heartbeat(f"n{i}", {})
    now[0] = 35.0  # n4 lapsed: reaped, and its row leaves both sets
    assert c.reap() == ["n4"]
    check(c)
    assert "n4" not in [r.node_id for r in c._candidates(None)]
    c.register("n4", "10.0.0.1:4", SPEC, 32)  # back, smaller
    check(c)
    assert c._block_size(SPEC) == 4
    try:
        c._block_size(None)
    except InvalidArgument as exc:  # two block sizes live: a spec must be named
        assert "several block sizes" in str(exc)
    else:
        raise AssertionError("two block sizes live, yet no spec was asked for")
    c.stop()


def test_an_open_syncs_its_own_set_and_the_others_catch_up_when_read() -> None:
    c = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
    for i in range(4):
        c.register(f"n{i}", f"10.0.0.1:{i}", SPEC, 64)
    check(c)
    c._count_open("n1", 5)
    c.heartbeat("n2", {"free_blocks": 10, "used_blocks": 54})
    assert list(c._candidates(SPEC)) == from_scratch(c, SPEC)
    assert c._dirty[None] == {"n1", "n2"}  # the set of every node: not rebuilt for this open
    assert list(c._candidates(None)) == from_scratch(c)
    assert c._block_size(None) == SPEC["block_size"]
    c.register("n9", "10.0.0.1:9", OTHER, 64)  # another block size joins
    assert list(c._candidates(SPEC)) == from_scratch(c, SPEC)  # (not in this set)
    with pytest.raises(InvalidArgument, match="several block sizes"):
        c._block_size(None)  # the set of every node sees it when read: the sizes are counted again
    check(c)
