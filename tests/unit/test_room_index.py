"""RoomIndex (coordinator/room_index.py): the rows kept between opens and the numpy ranking
of their snapshot must shortlist exactly as shortlist.shortlist over the same rows, through
updates, additions and removals; bad rows are refused and leave the index as it was."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.coordinator import rank_native
from pagedkv.coordinator.placement import PlacementWeights
from pagedkv.coordinator.rank_native import get_rank
from pagedkv.coordinator.records import NewSequence, NodeRoom
from pagedkv.coordinator.room_index import TIE_CACHE_MIN, RoomIndex
from pagedkv.coordinator.shortlist import Shortlist, shortlist
from pagedkv.protos.errors import InvalidArgument


@st.composite
def rooms(draw: Any, n: int) -> NodeRoom:
    total = draw(st.sampled_from([8, 16, 64]))
    free = draw(st.integers(0, total))
    return NodeRoom(
        f"node-{n:03d}",
        free,
        total,
        draw(st.integers(0, total - free)),
        draw(st.sampled_from([0.0, 1.0, 2.5]) | st.floats(0, 6, allow_nan=False)),
        draw(st.none() | st.sampled_from([0, 0, 4, 8])),
    )


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(1, 60))
    even = draw(st.booleans())  # a cold, even cluster: every node ties (the tie cache's path)
    rows = [NodeRoom(f"node-{i:03d}", 16, 16, 0, 0.0, 0) if even else draw(rooms(i)) for i in range(n)]
    return {
        "rows": rows,
        "changes": [draw(rooms(draw(st.integers(0, n + 3)))) for _ in range(draw(st.integers(0, 6)))],
        "removed": [f"node-{i:03d}" for i in draw(st.lists(st.integers(0, n - 1), max_size=3))],
        "need": draw(st.integers(1, 20)),
        "weights": PlacementWeights(
            1.0,
            draw(st.sampled_from([0.0, 0.1, 1.0])),
            draw(st.sampled_from([0.0, 0.05, 0.5, math.inf])),
            draw(st.sampled_from([0.0, 0.5, 2.0])),
            draw(st.sampled_from([0.0, 1.0, 4.0])),
            0.25,
        ),
        "tie_key": draw(st.binary(min_size=16, max_size=16)),
        "scan_classes": draw(st.sampled_from([0, 0b11110, 1 << 6])),
        "size": draw(st.integers(1, 4)),
        "scale": draw(st.sampled_from([1.0, 3.5, 2.0**40])),
    }


@settings(max_examples=300, deadline=None)
@given(sc=scenarios())
def test_snapshot_shortlists_as_the_rows_do(sc: dict[str, Any]) -> None:
    index = RoomIndex()
    index.update(sc["rows"])
    index.snapshot()  # an earlier snapshot must not leak into the later one
    index.update(sc["changes"])
    index.remove(sc["removed"])
    expect = {r.node_id: r for r in [*sc["rows"], *sc["changes"]]}
    for node_id in sc["removed"]:
        expect.pop(node_id, None)
    snap = index.snapshot()
    assert list(snap) == [expect[k] for k in sorted(expect)]
    args = (sc["need"], sc["weights"], sc["tie_key"], sc["scan_classes"], sc["size"], sc["scale"])
    want = shortlist(tuple(snap), *args[:4], size=args[4], opens_scale=args[5])
    assert shortlist(snap, *args[:4], size=args[4], opens_scale=args[5]) == want
    # numpy, then compiled twice: the second reads the tie ranks an even cluster's first kept
    for compiled in (False, True, True):
        assert Shortlist(*snap.shortlist(*args, compiled=compiled)) == want


@pytest.mark.skipif(not get_rank()[1].is_available, reason="no C compiler: numpy ranks alone")
def test_the_compiled_ranking_chooses_as_numpy_at_a_thousand_nodes() -> None:
    rng = random.Random(7)
    rows = [
        NodeRoom(
            f"n{i:05d}",
            f,
            64,
            rng.randint(0, 64 - f),
            rng.choice([0.0, 1.0, rng.random() * 4]),
            rng.choice([None, 0, 8, 8, 16]),
        )
        for i, f in enumerate(rng.choices([0, 8, 40, 64], k=1000))
    ]
    index = RoomIndex()
    index.update(rows)
    snap = index.snapshot()
    for need, slack, scan in [
        (4, 0.05, 0),
        (4, 0.05, 0b11110),
        (30, math.inf, 0b11110),
        (64, 0.5, 0),
        (65, 0.5, 0),
    ]:
        w = PlacementWeights(1.0, 0.1, slack, 0.5, 1.0, 0.25)
        for key in (b"\x03" * 16, bytes(range(16))):
            want = shortlist(tuple(rows), need, w, key, scan)
            assert Shortlist(*snap.shortlist(need, w, key, scan, 2, 1.0, compiled=True)) == want
            assert Shortlist(*snap.shortlist(need, w, key, scan, 2, 1.0, compiled=False)) == want


@pytest.mark.parametrize("compiled", [False, True])
def test_a_node_exactly_at_its_fair_share_is_within_the_bound(compiled: bool) -> None:
    # a: 1 open (its count + 1) for a fair share of (19 + 1) * 8 / 160 = 1 exactly: not over,
    # so it wins though busier; b: over
    rows = [
        NodeRoom(f"{n}{i:03d}", 8, 8, 0, o, act)
        for i in range(10)
        for n, o, act in [("a", 0.0, 4), ("b", 1.9, 0)]
    ]
    index = RoomIndex()
    index.update(rows)
    w = PlacementWeights(balance_slack=0.0, balance_margin=0.0, affinity_share=0.5)
    got = index.snapshot().shortlist(2, w, b"\x05" * 16, 0, 2, 1.0, compiled=compiled)
    assert all(i.startswith("a") for i in got[0]) and got[1:] == (19.0, 160)
    assert Shortlist(*got) == shortlist(tuple(rows), 2, w, b"\x05" * 16, 0)


def test_the_ranking_is_numpy_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_PURE_RANK", "1")
    rank, info = rank_native._load()
    assert rank is None and not info.is_available and "PAGEDKV_PURE_RANK" in info.detail


def test_an_even_cluster_resolves_ties_by_rendezvous_and_keeps_the_ranks() -> None:
    rows = [NodeRoom(f"n{i:04d}", 100, 100, 0, 0.0, 0) for i in range(4 * TIE_CACHE_MIN)]
    index = RoomIndex()
    index.update(rows)
    w = PlacementWeights()
    for key in (b"\x01" * 16, b"\x02" * 16, b"\x01" * 16):
        got = shortlist(index.snapshot(), 3, w, key, 0)
        assert got == shortlist(tuple(rows), 3, w, key, 0)
        assert len(got.ids) == 2
    assert len(index.snapshot()._cols.tie_pos) == 2  # one rank array per tie key, reused


def test_a_snapshot_is_a_new_sequences_candidates_as_it_is() -> None:
    index = RoomIndex()
    index.update([NodeRoom("b", 4, 8, 1, 0.0, None), NodeRoom("a", 8, 8)])
    snap = index.snapshot()
    new = NewSequence("s", "t", 4, 1, 4, b"", snap)
    assert new.candidates is snap
    assert [c.node_id for c in new.candidates] == ["a", "b"]


@pytest.mark.parametrize(
    "bad",
    [
        NodeRoom("a", 9, 8),  # free above total
        NodeRoom("a", -1, 8),
        NodeRoom("", 1, 8),
        NodeRoom("a", 1, 8, 0, math.inf),
        ("a", 1, 8, 0, 0.0, None),  # not a NodeRoom
    ],
)
def test_a_bad_row_is_refused_and_changes_nothing_after_it(bad: Any) -> None:
    index = RoomIndex()
    index.update([NodeRoom("a", 1, 8, 0, 0.0, None)])
    with pytest.raises(InvalidArgument, match="well-formed NodeRoom"):
        index.update([bad])
    assert list(index.snapshot()) == [NodeRoom("a", 1, 8, 0, 0.0, None)]


def _apply(table: dict[str, tuple[int, str]], args: Any) -> None:
    """What the open script does with a room table's args (redis_scripts.OPEN_SEQ): a row is
    written unless the stored one has a newer stamp."""
    for line in args.rows.split("\n")[1:]:
        node_id, stamp, rest = line.split("\t", 2)
        was = table.get(node_id)
        if was is None or was[0] < int(stamp):
            table[node_id] = (int(stamp), rest)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_room_table_sends_the_changed_rows_and_never_puts_back_older_ones(data: Any) -> None:
    """RoomTables over RoomIndex snapshots sends only rows changed since its last call (not a
    pass over all), and a snapshot sent late (a slower concurrent open) writes nothing older:
    once the newest snapshot is sent, the table holds exactly its rows."""
    from pagedkv.coordinator.room_table import RoomTables

    n = data.draw(st.integers(1, 30))
    index = RoomIndex()
    index.update(data.draw(rooms(i)) for i in range(n))
    tables = RoomTables(b"t:")
    table: dict[str, tuple[int, str]] = {}
    snaps = [index.snapshot()]
    first = tables.args(snaps[0])
    assert first.full and first.rows.count("\n") == n
    _apply(table, first)
    sent = snaps[0]
    for _ in range(data.draw(st.integers(1, 12))):
        changed = data.draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True))
        index.update(data.draw(rooms(i)) for i in changed)
        snaps.append(index.snapshot())
        late = data.draw(st.sampled_from(snaps))  # an older snapshot, sent after newer ones
        _apply(table, tables.args(late))
        sent = max(sent, late, key=lambda s: s.version)
        assert {k: v[1] for k, v in table.items()} == _fields(sent)  # the newest sent, never older
    newest = index.snapshot()
    last = tables.args(newest)
    assert not last.full
    _apply(table, last)
    assert tables.args(newest).rows == ""  # nothing changed since: nothing sent
    assert {k: v[1] for k, v in table.items()} == _fields(newest)


def _fields(rows: Any) -> dict[str, str]:
    return {
        r.node_id: f"{r.free_blocks}\t{r.total_blocks}\t{r.evictable_blocks}\t{r.recent_opens!r}\t"
        f"{-1 if r.active_blocks is None else r.active_blocks}"
        for r in rows
    }
