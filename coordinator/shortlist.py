"""The shortlist: which nodes an open weighs besides those holding its prompt.

placement.place ranks every candidate by (outside the balance bound, scan order, cost,
rendezvous tie). For a node that holds none of the prompt (cached = host = 0) and brings
nothing in flight (pending = 0) every term of that rank is known before the match:

    cost = overlap_weight * need + load_weight * (load + need)

so the best such nodes can be picked here, from the caller's table, without Redis. The open
script (redis_scripts.OPEN_SEQ) then weighs only the nodes holding the prompt's first key
(from the key -> nodes index), the node an in-flight marker names, and this shortlist: its
work no longer grows with the node count. Whether the open is a scan is known only after
the match, so the shortlist holds the best nodes in both orders when scans are possible.

The choice equals place() over every candidate when the best non-holder is among the first
`size` of its order that are live and hold nothing (the order uses the caller's sums of
recent opens and blocks; the script takes out of them the nodes it finds lapsed). What the
reply lists (scores, rejected) covers the nodes weighed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from .placement import SCAN_KEY, PlacementWeights, size_class, tie_rank
from .records import NodeRoom
from .room_index import CandidateRooms

SIZE = 2  # the best non-holders weighed per order (plain and scan): one spare for a lapsed one
WEIGH_ALL = 16  # up to this many candidates the script weighs every one (no shortlist)


class Shortlist(NamedTuple):
    """ids: the nodes to weigh besides the holders (plain order first, then scan order);
    sum_opens, sum_total: the balance bound's sums over every candidate."""

    ids: tuple[str, ...]
    sum_opens: float
    sum_total: int


@lru_cache(maxsize=1 << 16)
def _scan_rank(node_id: str) -> str:
    return tie_rank(SCAN_KEY, node_id)  # fixed per node: hashed once, not once per open


def shortlist(
    candidates: Sequence[NodeRoom],
    need: int,
    weights: PlacementWeights,
    tie_key: bytes,
    scan_classes: int,
    size: int = SIZE,
    opens_scale: float = 1.0,
) -> Shortlist:
    """The `size` best candidates for an open of `need` blocks as if each held none of the
    prompt, in place()'s order (and as many in its scan order when scan_classes is not 0);
    nodes without room for `need` are left out (they are rejected unless they hold some of
    it, and then the index lists them); opens_scale: recent_opens is that many times each
    node's count (NewSequence.opens_scale). O(N log size), a sha1 only for ties of the last
    place. Pure. A RoomIndex snapshot ranks itself in numpy, with the same result
    (room_index.py)."""
    if isinstance(candidates, CandidateRooms):
        return Shortlist(*candidates.shortlist(need, weights, tie_key, scan_classes, size, opens_scale))
    sum_opens = math.fsum(c.recent_opens for c in candidates) / opens_scale  # as RoomIndex keeps it
    sum_total = sum(c.total_blocks for c in candidates)
    ow, lw, hw = weights.overlap_weight, weights.load_weight, weights.host_weight
    slack, margin, aff = weights.balance_slack, weights.balance_margin, weights.affinity_share
    ranked: list[Row] = []
    for c in candidates:
        room = c.free_blocks + c.evictable_blocks
        if need > room:
            continue
        load = c.total_blocks - room if c.active_blocks is None else c.active_blocks
        cost = ow * need + hw * 0 + lw * (load + need)  # placement's terms, in its order
        fair = (sum_opens + 1) * c.total_blocks / sum_total if sum_total else 0.0
        opens = c.recent_opens / opens_scale + 1
        over = opens > (1.0 + slack) * fair + margin
        over = over and (aff * need > 0 or opens > (1.0 + 2 * slack) * fair + 2 * margin)
        ranked.append((over, cost, c.node_id))
    ids = _best(ranked, size, tie_key, lambda r: (r[0], r[1]))
    if scan_classes & ((2 << size_class(need)) - 1):  # a scan is possible: its run fits the need
        scans = [(over, _scan_rank(node_id), cost, node_id) for over, cost, node_id in ranked]
        more = _best(scans, size, tie_key, lambda r: (r[0], r[1], r[2]))
        ids += tuple(i for i in more if i not in ids)
    return Shortlist(ids, sum_opens, sum_total)


Row = tuple[Any, ...]  # (rank terms..., node_id)


def _best(ranked: list[Row], size: int, tie_key: bytes, head: Callable[[Row], Row]) -> tuple[str, ...]:
    """The `size` smallest by (head, rendezvous tie); the tie hashed only where the head of the
    last one taken is shared by others (their order decides who is in)."""
    first = heapq.nsmallest(size, ranked, key=head)
    if len(first) < size or not first:
        tied: list[Row] = []
    else:
        last = head(first[-1])
        tied = [r for r in ranked if head(r) == last]
    keep = [r for r in first if not tied or head(r) != head(first[-1])]
    tied.sort(key=lambda r: tie_rank(tie_key, r[-1]))
    keep += tied[: size - len(keep)]
    keep.sort(key=lambda r: (head(r), tie_rank(tie_key, r[-1])))
    return tuple(r[-1] for r in keep)
