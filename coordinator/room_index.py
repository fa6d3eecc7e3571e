"""The room index: the coordinator's candidate rows kept ranked between opens.

An open at N nodes used to build N rows (NodeRoom), check them, and rank them in Python for
the shortlist (shortlist.py): ~4 us a node, most of the open's coordinator CPU at 1,000
nodes. Here a row is built and checked once when its node changes (a beat, an open or a
close placed there, a registration), kept in node_id order, and mirrored in numpy columns;
an open takes a snapshot (a tuple of the rows and a copy of the columns: C-speed copies)
and ranks it with array operations that compute placement's terms in the same order as
shortlist.shortlist, so the floats and the choice are the same.

Ties of the rank head (a cold, even cluster: every node costs the same) resolve by the
rendezvous rank of each node for the prompt's first key, a sha1 per node: above TIE_CACHE_MIN
tied nodes the ranks of every node for that key are computed once and kept (TIE_KEYS keys,
until the membership changes): prompts sharing a first key (a system prompt) share them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..protos.errors import InvalidArgument
from .placement import SCAN_KEY, PlacementWeights, size_class, tie_rank
from .rank_native import MAX_WANT, get_rank
from .records import CheckedRooms, NodeRoom, has_separators, is_checked_room

TIE_CACHE_MIN = 8  # tied nodes above which every node's rank for the key is computed and kept
TIE_KEYS = 64  # tie keys whose ranks are kept per membership
# Every finite double is an integer multiple of 2**-1074: sums of these integers are exact,
# and int / int division rounds once, as math.fsum does (kept per change, not per open).
_EXACT_SCALE = 1 << 1074


def _exact(x: float) -> int:
    num, den = x.as_integer_ratio()  # den: a power of two no larger than _EXACT_SCALE
    return num * (_EXACT_SCALE // den)


def _active(r: NodeRoom) -> int:
    return -1 if r.active_blocks is None else r.active_blocks


class _Columns:
    """One membership's node order and its numpy columns (replaced whole when it changes)."""

    def __init__(self, rows: Sequence[NodeRoom]) -> None:
        self.ids = tuple(r.node_id for r in rows)
        self.pos = {node_id: i for i, node_id in enumerate(self.ids)}
        self.has_separators = has_separators(self.ids)  # once per membership, not per open
        self.everyone = np.arange(len(rows))
        # free, total, evictable, active (-1: None) per node: one block, one copy per snapshot
        self.ints = (
            np.array(
                [[r.free_blocks, r.total_blocks, r.evictable_blocks, _active(r)] for r in rows],
                dtype=np.int64,
            )
            .reshape(len(rows), 4)
            .T.copy()
        )
        self.opens = np.array([r.recent_opens for r in rows], dtype=np.float64)
        self.opens_exact = sum(_exact(r.recent_opens) for r in rows)  # math.fsum's sum, kept exact
        by_scan = sorted(range(len(rows)), key=lambda i: tie_rank(SCAN_KEY, self.ids[i]))
        self.scan_pos = np.empty(len(rows), dtype=np.int64)
        self.scan_pos[by_scan] = np.arange(len(rows))
        self.scan_ptr = self.scan_pos.ctypes.data  # (the compiled ranking reads it in place)
        self.tie_pos: dict[bytes, np.ndarray] = {}  # tie key -> each node's rank position

    def set(self, i: int, r: NodeRoom) -> None:
        self.ints[:, i] = (r.free_blocks, r.total_blocks, r.evictable_blocks, _active(r))
        self.opens_exact += _exact(r.recent_opens) - _exact(float(self.opens[i]))
        self.opens[i] = r.recent_opens

    def tie_positions(self, tie_key: bytes) -> np.ndarray:
        pos = self.tie_pos.get(tie_key)
        if pos is None:
            ranks = [tie_rank(tie_key, node_id) for node_id in self.ids]
            order = sorted(range(len(ranks)), key=ranks.__getitem__)
            pos = np.empty(len(ranks), dtype=np.int64)
            pos[order] = np.arange(len(ranks))
            if len(self.tie_pos) >= TIE_KEYS:
                self.tie_pos.clear()
            self.tie_pos[tie_key] = pos
        return pos


class CandidateRooms(CheckedRooms):
    """A snapshot of a RoomIndex: its rows (NodeRoom, node_id order, distinct, checked: a
    NewSequence takes them as they are) and its columns as they were, for `shortlist`."""

    _cols: _Columns
    _arrays: tuple[np.ndarray, np.ndarray]  # _Columns.ints, _Columns.opens
    _ptrs: tuple[int, int]  # their addresses, for the compiled ranking
    _sum_opens: float  # math.fsum of the unscaled recent opens
    _index: RoomIndex
    version: int  # the index's change count when taken

    def node_ids(self) -> tuple[str, ...]:
        return self._cols.ids  # the same tuple until the membership changes

    def has_separators(self) -> bool:
        return self._cols.has_separators

    @property
    def source(self) -> int:
        """Which RoomIndex took it (unique in the process): versions compare within one."""
        return self._index.uid

    def changed_since(self, version: int) -> list[NodeRoom]:
        """This snapshot's rows whose node changed after `version` (of the same index, the
        newest snapshot a room table was sent): O(changed), not O(N)."""
        return self._index.changed_rows(self, version)

    def shortlist(
        self,
        need: int,
        weights: PlacementWeights,
        tie_key: bytes,
        scan_classes: int,
        size: int,
        opens_scale: float,
        compiled: bool = True,
    ) -> tuple[tuple[str, ...], float, int]:
        """shortlist.shortlist over these rows: (ids, sum_opens, sum_total). Pure. Ranked by
        csrc/rank_rooms.c where it loaded (`compiled`), else in numpy: the same choice."""
        sum_opens = self._sum_opens / opens_scale
        scans = scan_classes & ((2 << size_class(need)) - 1)  # a scan is possible: its run fits the need
        if _RANK is not None and compiled and size <= MAX_WANT:
            w = weights  # the terms as the numpy ranking below rounds them
            terms: tuple[Any, ...] = (
                need,
                w.overlap_weight * need + w.host_weight * 0,
                w.load_weight,
                sum_opens + 1,
            )
            terms += (opens_scale, 1.0 + w.balance_slack, w.balance_margin, not w.affinity_share * need > 0)
            terms += (1.0 + 2 * w.balance_slack, 2 * w.balance_margin, size)
            ids, sum_total = self._shortlist_compiled(terms, tie_key, bool(scans))
            return ids, sum_opens, sum_total
        (free, total, evictable, active), opens_scaled = self._arrays
        opens_per = opens_scaled / opens_scale
        sum_total = int(total.sum())
        ow, lw, hw = weights.overlap_weight, weights.load_weight, weights.host_weight
        slack, margin, aff = weights.balance_slack, weights.balance_margin, weights.affinity_share
        room = free + evictable
        fits = need <= room
        pick: slice | np.ndarray
        if fits.all():  # (the usual case: views, no copies by index)
            eligible, pick = self._cols.everyone, slice(None)
        else:
            eligible = pick = np.flatnonzero(fits)
        load = np.where(active < 0, total - room, active)[pick]
        cost = (ow * need + hw * 0) + lw * (load + need)
        # An unbounded slack times a zero fair share is nan (not over): numpy's warning is muted.
        with np.errstate(invalid="ignore") if math.isinf(slack) else contextlib.nullcontext():
            fair = (sum_opens + 1) * total[pick] / sum_total if sum_total else np.zeros(len(eligible))
            opens = opens_per[pick] + 1
            over = opens > (1.0 + slack) * fair + margin
            if not aff * need > 0:
                over &= opens > (1.0 + 2 * slack) * fair + 2 * margin
        ids = self._best(eligible, (over, cost), size, tie_key)
        if scans:
            scan = self._cols.scan_pos[eligible]
            more = self._best(eligible, (over, scan, cost), size, tie_key)
            ids += tuple(i for i in more if i not in ids)
        return ids, sum_opens, sum_total

    def _shortlist_compiled(
        self, terms: tuple[Any, ...], tie_key: bytes, scans: bool
    ) -> tuple[tuple[str, ...], int]:
        """shortlist() by csrc/rank_rooms.c, both orders in one pass over the rows:
        (ids, sum_total). `terms`: the ranking's arguments after the tie positions."""
        cols, n, size = self._cols, len(self), terms[-1]
        tie = cols.tie_pos.get(tie_key)  # kept ranks order every row: no ties left to settle
        section = 3 + 2 * size + n
        out = np.empty(2 * section if scans else section, dtype=np.int64)
        scan_ptr, tie_ptr = cols.scan_ptr if scans else None, None if tie is None else tie.ctypes.data
        code = _RANK(n, *self._ptrs, scan_ptr, tie_ptr, *terms, out.ctypes.data)
        if code != 0:
            raise MemoryError(f"the compiled shortlist ranking failed ({code})")
        ids = self._ranked(out, size, tie_key)
        if scans:
            ids += tuple(i for i in self._ranked(out[section:], size, tie_key) if i not in ids)
        return ids, int(out[2])

    def _ranked(self, out: np.ndarray, size: int, tie_key: bytes) -> tuple[str, ...]:
        """One order's `size` first rows from its section of the compiled ranking's output:
        rows of equal heads (no tie ranks were kept) settled by rendezvous rank here."""
        nb, nt = out[:2].tolist()
        best = out[3 : 3 + nb].tolist()
        ids = self._cols.ids
        groups = out[3 + size : 3 + size + nb].tolist()
        if nb > 1 and groups[-1] < nb - 1:
            order = sorted(range(nb), key=lambda j: (groups[j], tie_rank(tie_key, ids[best[j]])))
            best = [best[j] for j in order]
        if nt:
            tied = out[3 + 2 * size : 3 + 2 * size + nt]
            best += self._by_rank(self._cols.everyone, tied, size - nb, tie_key) if nt > 1 else tied.tolist()
        return tuple(ids[i] for i in best)

    def _best(
        self, eligible: np.ndarray, head: tuple[np.ndarray, ...], size: int, tie_key: bytes
    ) -> tuple[str, ...]:
        """The `size` smallest eligible rows by (head, rendezvous tie), as shortlist._best."""
        if not len(eligible):
            return ()
        chosen = self._select(eligible, np.arange(len(eligible)), head, size, tie_key)
        ids = self._cols.ids
        chosen.sort(key=lambda i: (*(column[i] for column in head), tie_rank(tie_key, ids[eligible[i]])))
        return tuple(ids[eligible[i]] for i in chosen)

    def _select(
        self, eligible: np.ndarray, rows: np.ndarray, head: tuple[np.ndarray, ...], want: int, tie_key: bytes
    ) -> list[int]:
        """Which `want` of `rows` rank first by (head, rendezvous tie), in no order: a partial
        selection on head's first column (O(N); a full lexsort of 1,000 rows cost ~70 us)
        keeps the rows below its cut and settles those at the cut by the next column."""
        if want <= 0:
            return []
        if len(rows) <= want:
            return rows.tolist()  # type: ignore[no-any-return]
        if not head:
            return self._by_rank(eligible, rows, want, tie_key)
        values = head[0][rows]
        if values.dtype == np.bool_:  # (the balance bound: no partition needed to find the cut)
            inside = rows[~values]
            if len(inside) >= want:
                return self._select(eligible, inside, head[1:], want, tie_key)
            rest = self._select(eligible, rows[values], head[1:], want - len(inside), tie_key)
            return inside.tolist() + rest  # type: ignore[no-any-return]
        cut = values[np.argpartition(values, want - 1)[want - 1]]
        below = rows[values < cut]  # fewer than `want`: the cut is the want-th smallest
        tied = rows[values == cut]
        return below.tolist() + self._select(eligible, tied, head[1:], want - len(below), tie_key)  # type: ignore[no-any-return]

    def _by_rank(self, eligible: np.ndarray, tied: np.ndarray, want: int, tie_key: bytes) -> list[int]:
        """The `want` of `tied` (rows equal on every head column) first by rendezvous rank."""
        if len(tied) > TIE_CACHE_MIN:
            ranks = self._cols.tie_positions(tie_key)[eligible[tied]]  # distinct: a partition is exact
            first = np.argpartition(ranks, want - 1)[:want] if want < len(ranks) else np.arange(len(ranks))
            return tied[first[np.argsort(ranks[first])]].tolist()  # type: ignore[no-any-return]
        ids = self._cols.ids
        return sorted(tied.tolist(), key=lambda i: tie_rank(tie_key, ids[eligible[i]]))[:want]


_uids = itertools.count(1)
# csrc/rank_rooms.c's entry point, or None (rank_native.py logs why): built here, at import,
# as the key chain is, so that no open waits on the compiler.
_RANK = get_rank()[0]


class RoomIndex:
    """One candidate set's rows (a model spec's nodes, or every node). Thread-safe."""

    def __init__(self) -> None:
        self.uid = next(_uids)
        self._lock = threading.Lock()
        self._rows: dict[str, NodeRoom] = {}  # node_id order
        self._cols = _Columns(())
        self._snapshot: CandidateRooms | None = None
        # node -> the change count at its row's last change, oldest first: a room table
        # asks for the rows changed since it last sent (room_table.py) without a pass over all.
        self._version = 0
        self._changes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._rows

    def update(self, rows: Iterable[NodeRoom]) -> None:
        """Put these rows (a new node's, or a changed one's). Raises InvalidArgument, changing
        nothing, when one is a row NewSequence would refuse."""
        rows = list(rows)
        for r in rows:
            if not is_checked_room(r):
                raise InvalidArgument(f"a candidate room must be a well-formed NodeRoom, got {r!r}")
        with self._lock:
            added, version = False, self._version
            for r in rows:
                if self._rows.get(r.node_id) == r:
                    continue  # (a beat that changed nothing placement reads)
                i = self._cols.pos.get(r.node_id)
                if i is None:
                    added = True
                else:
                    self._cols.set(i, r)
                self._rows[r.node_id] = r
                self._version += 1
                self._changes.pop(r.node_id, None)
                self._changes[r.node_id] = self._version
            if added:
                self._rebuild()
            if self._version != version:
                self._snapshot = None  # (kept when no row changed)

    def remove(self, node_ids: Iterable[str]) -> None:
        with self._lock:
            gone = [n for n in list(node_ids) if self._rows.pop(n, None) is not None]
            for n in gone:
                self._changes.pop(n, None)
            if gone:
                self._rebuild()
                self._snapshot = None

    def snapshot(self) -> CandidateRooms:
        """The rows now, with their columns (an open's candidates)."""
        with self._lock:
            snap = self._snapshot
            if snap is None:
                cols = self._cols
                snap = self._snapshot = CandidateRooms(self._rows.values())
                snap._cols = cols
                snap._arrays = (cols.ints.copy(), cols.opens.copy())
                snap._ptrs = (snap._arrays[0].ctypes.data, snap._arrays[1].ctypes.data)
                snap._sum_opens = cols.opens_exact / _EXACT_SCALE
                snap._index, snap.version = self, self._version
            return snap

    def changed_rows(self, snap: CandidateRooms, version: int) -> list[NodeRoom]:
        """CandidateRooms.changed_since: the rows changed after `version`, as `snap` has them.
        A row changed again after the snapshot goes as the snapshot has it (no newer one was
        sent: `version` would be past it); a snapshot older than `version` sends nothing (its
        rows may be older than those sent)."""
        if snap.version < version:
            return []
        pos = snap._cols.pos
        out: list[NodeRoom] = []
        with self._lock:
            for node_id, v in reversed(self._changes.items()):
                if v <= version:
                    break
                i = pos.get(node_id)
                if i is not None:
                    out.append(snap[i])
        return out

    def _rebuild(self) -> None:
        self._rows = dict(sorted(self._rows.items()))
        self._cols = _Columns(list(self._rows.values()))
