"""Placement: which node gets a new sequence. One pure function, `place`.

The rule: N nodes should cache like one pool. Work saved is traded against load in one unit,
blocks (as the Dynamo KV router and SGLang's cache-aware router do), under a balance bound:

    cached  = leading prompt blocks the node holds (match_prefix), at most `needed`
    host    = of those, the ones on its host tier (the tail of the run: a node serves its
              device blocks first), copied back to device blocks at open
    pending = further leading blocks an open in flight will put there (see below)
    new     = needed - cached                       blocks it must allocate and compute
    work    = new - pending                         prefill left for this open on that node
    load    = blocks of the sequences the coordinator placed there and has not closed
              (`active_blocks`; without it, total - free - evictable from the node's report)
    cost    = overlap_weight * work + host_weight * host
              + load_weight * (load + new + host)                           (lower wins)
    room    : new + host <= free + evictable, or the node is not a candidate

    bound   : opens + 1 <= (1 + balance_slack) * fair + balance_margin, or else both
              cached >= affinity_share * needed  and
              opens + 1 <= (1 + 2 * balance_slack) * fair + 2 * balance_margin
    fair    = (sum of opens over candidates + 1) * total / (sum of total)
    rank    = (outside the bound, scan order if a scan, cost, rendezvous tie)  (smallest wins)

where `opens` is the node's recent opens (the coordinator's count, decayed by a half-life),
so the bound keeps requests, not only blocks, spread in proportion to node size.

Load is what the coordinator itself placed, not what the nodes last reported: a report is up
to a heartbeat old, on a busy cluster a different set of running sequences, so choices between
nodes that hold nothing of a prompt followed timing instead of load (bench/README, "Cluster
placement"). Evictable cached blocks are room (an allocation may take them) but neither load
nor idle capacity.

With the default weights (1, 0.1) a cached block saves one block of prefill and ten blocks of
someone else's running sequences cost as much: a conversation goes where its history is unless
that node is busier by ten times the history's size. A block on the host tier saves all but
`host_weight` of its prefill (a copy back instead of a recomputation) and takes a device block
like a new one. A prefix that every request shares (a system prompt) is worth its length only
against nodes that do not have it, so once a node is busier than the others by that much, the
next request lands elsewhere, computes the prefix there, and from then on every node has it:
hot prefixes replicate by their own misses instead of herding every request onto one node.
The bound caps that herding outright: a node more than `balance_slack` above its fair share of
recent opens (plus `balance_margin` opens, so that a quiet cluster still places by cache) is not
chosen for a small gain while another is within it: only a prompt it holds at least
`affinity_share` of (a conversation's next turn) may still go there, up to twice the slack. The
node with the fewest opens for its size is always within it. A node that joins or comes back
empty starts at its fair share of recent opens (Coordinator.register; not at its count from
before it died, nor at 0, which would send it every open until it caught up, each a miss): with
no load it wins the opens that no node holds much of, and the others' bound sends it the rest of
its share while it computes the hot prefixes it lacks.

Scans (`scan_classes`): long prompts that nobody asks for again (a pasted document) flush every
node's cache a little; sent to the same node they flush one. The coordinator learns which sizes
of uncached run are seldom continued (coordinator/reuse.py) and names their size classes; an
open whose fewest uncached blocks on any node, bit_length(needed - max cached), is in one is a
scan and goes to the first node within the bound in a fixed rendezvous order (SCAN_KEY), the
next one once that one is over its share. The other nodes keep their history for the
conversations.

Concurrent opens of one uncached prefix (in-flight dedup): an open that computes blocks no node
holds leaves a marker on its first uncached key naming its node and how many keys it brings, for
the open's `pending_ttl_ms` or until a node reports that key stored. A later open whose prompt
continues through that key counts those blocks as `pending` on that node (work it will not have
to do there once the first open publishes), so both land on one node and the prefix is computed
and cached once. Pending blocks change the choice only: `cached_blocks` (what the node will
take) counts held blocks alone.

Remaining ties go by rendezvous hashing: to the node whose sha1(tie_key + node_id) is smallest,
tie_key being the prompt's first block key, so every replica picks alike and prompts that start
alike land together while different ones spread. A node without room for `new + host` is never
chosen (listed in `rejected`); if none has room, CapacityExceeded.

This function is the specification: RedisStore.open_sequence runs a Lua port of it inside Redis
(match, place and write in one round trip), MemoryStore calls it, and a property test
(tests/contract/test_placement_port.py) checks that both choose alike.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedkv.protos.errors import CapacityExceeded, InvalidArgument, Unavailable

SCAN_KEY = b"pagedkv:scan"  # the rendezvous key that orders nodes for scans (every replica alike)


@dataclass(frozen=True)
class NodeCandidate:
    """A live node as placement sees it (from its load report, the coordinator's counts and
    match_prefix()).

    cached_blocks: leading prompt blocks it holds on either tier; host_blocks: of those, the
    ones on its host tier. free_blocks: never-keyed blocks; evictable_blocks: cached blocks no
    sequence holds (room, at the price of the cache they hold). pending_blocks: blocks after the
    cached prefix that an open in flight is bringing to this node. recent_opens: the opens
    placed on it lately (decayed). active_blocks: the blocks of running sequences the
    coordinator placed there (None: the rest of total_blocks after free and evictable).
    """

    node_id: str
    cached_blocks: int
    free_blocks: int
    total_blocks: int
    evictable_blocks: int = 0
    pending_blocks: int = 0
    recent_opens: float = 0.0
    active_blocks: int | None = None
    host_blocks: int = 0

    def __post_init__(self) -> None:
        names = (
            "cached_blocks",
            "free_blocks",
            "total_blocks",
            "evictable_blocks",
            "pending_blocks",
            "host_blocks",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"NodeCandidate.{name} must be an int >= 0, got {value!r}")
        active = self.active_blocks
        if active is not None and (not isinstance(active, int) or isinstance(active, bool) or active < 0):
            raise InvalidArgument(f"NodeCandidate.active_blocks must be None or an int >= 0, got {active!r}")
        opens = self.recent_opens
        if not isinstance(opens, int | float) or isinstance(opens, bool) or not 0 <= opens < math.inf:
            raise InvalidArgument(f"NodeCandidate.recent_opens must be a finite number >= 0, got {opens!r}")
        if self.free_blocks + self.evictable_blocks > self.total_blocks:
            raise InvalidArgument(
                f"node {self.node_id!r}: free_blocks {self.free_blocks} + evictable_blocks "
                f"{self.evictable_blocks} > total_blocks {self.total_blocks}"
            )
        if self.host_blocks > self.cached_blocks:
            raise InvalidArgument(
                f"node {self.node_id!r}: host_blocks {self.host_blocks} > cached_blocks {self.cached_blocks}"
            )

    @property
    def room_blocks(self) -> int:
        """What an allocation can take: free plus evictable."""
        return self.free_blocks + self.evictable_blocks

    @property
    def load_blocks(self) -> int:
        """The load placement counts: active_blocks when given, else total minus room."""
        return self.total_blocks - self.room_blocks if self.active_blocks is None else self.active_blocks


@dataclass(frozen=True)
class PlacementWeights:
    """overlap_weight: cost of one block of prefill; host_weight: cost of copying one block back
    from a host tier; load_weight: cost of one active block; balance_slack: how far above its
    fair share of recent opens a node may be and still be chosen (math.inf: no bound), plus
    balance_margin opens; affinity_share: the share of a prompt a node must hold to be chosen
    above the bound (above 1: never)."""

    overlap_weight: float = 1.0
    load_weight: float = 0.1
    balance_slack: float = 0.05
    affinity_share: float = 0.5
    balance_margin: float = 4.0
    # A copy over PCIe costs a fraction of the prefill it saves (for a 7B fp16 model a 16-token
    # block is 8 MiB, ~0.3 ms at 25 GB/s, against ~1 ms of prefill on one GPU); tunable per fleet.
    host_weight: float = 0.25

    def __post_init__(self) -> None:
        names = (
            "overlap_weight",
            "load_weight",
            "balance_slack",
            "affinity_share",
            "balance_margin",
            "host_weight",
        )
        for name in names:
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
            if not ok or (name != "balance_slack" and not math.isfinite(value)) or math.isnan(value):
                raise InvalidArgument(f"PlacementWeights.{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class Placement:
    """The chosen node, what it already caches, and every score (-cost, higher wins)."""

    node_id: str
    cached_blocks: int
    cached_tokens: int
    new_blocks: int
    scores: Mapping[str, float] = field(default_factory=dict)  # feasible nodes only
    rejected: tuple[str, ...] = ()  # nodes without room for their uncached remainder
    pending_blocks: int = 0  # of new_blocks, those an open in flight brings to the node
    cached_elsewhere_blocks: int = 0  # the most any other candidate holds (why a miss missed)
    cached_elsewhere_node_id: str = ""  # that candidate (the smallest id among equals; "" if none holds any)
    host_blocks: int = 0  # of cached_blocks, those copied back from the node's host tier
    is_scan: bool = False  # placed as a scan (its size class was in scan_classes)


def size_class(num_blocks: int) -> int:
    """The size class of an uncached run: its bit length (0, 1, 2-3, 4-7, ... blocks)."""
    return num_blocks.bit_length()


def place(
    candidates: Sequence[NodeCandidate],
    num_blocks_needed: int,
    block_size: int,
    weights: PlacementWeights | None = None,
    tie_key: bytes = b"",
    scan_classes: int = 0,
) -> Placement:
    """Choose the node for a sequence needing `num_blocks_needed` blocks in all;
    tie_key (the prompt's first block key, b"" for a prompt under one block) orders
    equal scores; scan_classes is a bit mask of size classes placed as scans (bit c:
    size_class c). See the module docstring.

    Raises Unavailable if there are no candidates (no live node), CapacityExceeded
    if none can hold its uncached remainder, InvalidArgument on bad input. Pure.
    """
    weights = weights or PlacementWeights()
    if not isinstance(num_blocks_needed, int) or num_blocks_needed < 0:
        raise InvalidArgument(f"num_blocks_needed must be an int >= 0, got {num_blocks_needed!r}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgument(f"block_size must be an int > 0, got {block_size!r}")
    if not isinstance(scan_classes, int) or isinstance(scan_classes, bool) or not 0 <= scan_classes < 1 << 52:
        raise InvalidArgument(f"scan_classes must be an int bit mask in [0, 2**52), got {scan_classes!r}")
    if not candidates:
        raise Unavailable("no live cache node to place a sequence on")
    if len({c.node_id for c in candidates}) != len(candidates):
        raise InvalidArgument("candidates must have distinct node ids")

    need = num_blocks_needed
    fewest_new = need - max(min(c.cached_blocks, need) for c in candidates)
    is_scan = bool(scan_classes >> size_class(fewest_new) & 1)
    sum_opens = sum(c.recent_opens for c in candidates)
    sum_total = sum(c.total_blocks for c in candidates)
    scores: dict[str, float] = {}
    rejected: list[str] = []
    best: tuple[tuple[bool, str, float, str], NodeCandidate, int, int, int] | None = None
    for c in candidates:
        cached, host = _usable(c, need)
        new = need - cached
        if new + host > c.room_blocks:
            rejected.append(c.node_id)
            continue
        pending = min(c.pending_blocks, new)
        after = c.load_blocks + new + host
        cost = (
            weights.overlap_weight * (new - pending)
            + weights.host_weight * host
            + weights.load_weight * after
        )
        scores[c.node_id] = -cost
        fair = (sum_opens + 1) * c.total_blocks / sum_total if sum_total else 0.0
        opens = c.recent_opens + 1
        slack = weights.balance_slack
        margin = weights.balance_margin
        over = opens > (1.0 + slack) * fair + margin
        over = over and (
            cached < weights.affinity_share * need or opens > (1.0 + 2 * slack) * fair + 2 * margin
        )
        order = tie_rank(SCAN_KEY, c.node_id) if is_scan else ""
        rank = (over, order, cost, tie_rank(tie_key, c.node_id))  # within the bound first; deterministic
        if best is None or rank < best[0]:
            best = (rank, c, cached, pending, host)

    if best is None:
        fewest = min(need - cached + host for cached, host in (_usable(c, need) for c in candidates))
        raise no_room(need, fewest, max(c.room_blocks for c in candidates))
    _, chosen, cached, pending, host = best
    elsewhere, elsewhere_id = 0, ""
    for c in sorted(candidates, key=lambda c: c.node_id):
        if c is not chosen and min(c.cached_blocks, need) > elsewhere:
            elsewhere, elsewhere_id = min(c.cached_blocks, need), c.node_id
    return Placement(
        node_id=chosen.node_id,
        cached_blocks=cached,
        cached_tokens=cached * block_size,
        new_blocks=need - cached,
        scores=scores,
        rejected=tuple(sorted(rejected)),
        pending_blocks=pending,
        cached_elsewhere_blocks=elsewhere,
        cached_elsewhere_node_id=elsewhere_id,
        host_blocks=host,
        is_scan=is_scan,
    )


def _usable(c: NodeCandidate, need: int) -> tuple[int, int]:
    """(cached, host): the node's cached run cut at the need, and how many of those are on its
    host tier (the tail of the run: device blocks come first)."""
    cached = min(c.cached_blocks, need)
    return cached, max(0, c.host_blocks - (c.cached_blocks - cached))


def tie_rank(tie_key: bytes, node_id: str) -> str:
    """The rendezvous rank of node_id for tie_key (smaller wins a tie); the Redis
    store's Lua port computes the same with redis.sha1hex."""
    return hashlib.sha1(tie_key + node_id.encode()).hexdigest()


def no_room(num_blocks_needed: int, fewest_uncached: int, most_room: int) -> CapacityExceeded:
    """place()'s error when no candidate has room (the Redis store's Lua port raises the same)."""
    return CapacityExceeded(
        f"no node can hold a {num_blocks_needed}-block sequence (fewest uncached blocks on any node)",
        requested=fewest_uncached,
        available=most_room,
    )
