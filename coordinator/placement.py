"""Placement: which node gets a new sequence. One pure function, `place`.

Scored the way the Dynamo KV router does: the cached prefix first, then load.
For each candidate node

    cached  = leading prompt blocks the node already holds (match_prefix), at most `needed`
    new     = needed - cached                 blocks it must allocate
    load    = (used_blocks + new) / total     its utilisation after the placement, in [0, 1]

    score   = overlap_weight * cached - load_weight * load          (higher wins)

With the defaults (1.0, 1.0) one cached block outweighs any difference in load,
so the longest cached prefix wins and load only breaks ties between equal
prefixes; raise load_weight to trade cache hits for balance (load_weight = 8:
an idle node beats a full one unless the full one caches 8 more blocks).
Remaining ties (equally loaded nodes caching none of the prompt: a new system
prompt on an idle cluster) go by rendezvous hashing: to the node whose
sha1(tie_key + node_id) is smallest, tie_key being the prompt's first block key.
Every coordinator replica picks the same node for the same inputs, prompts that
start alike land together (their prefix will be cached there), and different
prompts spread over the nodes instead of all going to the smallest node id.

A node whose free blocks cannot hold `new` is never chosen (it is listed in
`rejected`); if no node can, CapacityExceeded names the need.

This function is the specification: RedisStore.open_sequence runs a Lua port of
it inside Redis (match, place and write in one round trip), and a property test
(tests/contract/test_placement_port.py) checks that both choose alike.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedkv.protos.errors import CapacityExceeded, InvalidArgument, Unavailable


@dataclass(frozen=True)
class NodeCandidate:
    """A live node as placement sees it (from live_nodes() load and match_prefix()).

    free_blocks: blocks it can allocate now (free, plus cached-but-evictable ones
    if its heartbeat counts them so), not counting the cached prefix itself.
    """

    node_id: str
    cached_blocks: int
    free_blocks: int
    total_blocks: int

    def __post_init__(self) -> None:
        for name in ("cached_blocks", "free_blocks", "total_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"NodeCandidate.{name} must be an int >= 0, got {value!r}")
        if self.free_blocks > self.total_blocks:
            raise InvalidArgument(
                f"node {self.node_id!r}: free_blocks {self.free_blocks} > total_blocks {self.total_blocks}"
            )

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


@dataclass(frozen=True)
class PlacementWeights:
    overlap_weight: float = 1.0
    load_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "load_weight"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"PlacementWeights.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Placement:
    """The chosen node, what it already caches, and every score (for debugging and metrics)."""

    node_id: str
    cached_blocks: int
    cached_tokens: int
    new_blocks: int
    scores: Mapping[str, float] = field(default_factory=dict)  # feasible nodes only
    rejected: tuple[str, ...] = ()  # nodes without room for their uncached remainder


def place(
    candidates: Sequence[NodeCandidate],
    num_blocks_needed: int,
    block_size: int,
    weights: PlacementWeights | None = None,
    tie_key: bytes = b"",
) -> Placement:
    """Choose the node for a sequence needing `num_blocks_needed` blocks in all;
    tie_key (the prompt's first block key, b"" for a prompt under one block) orders
    equal scores (see the module docstring).

    Raises Unavailable if there are no candidates (no live node), CapacityExceeded
    if none can hold its uncached remainder, InvalidArgument on bad input. Pure.
    """
    weights = weights or PlacementWeights()
    if not isinstance(num_blocks_needed, int) or num_blocks_needed < 0:
        raise InvalidArgument(f"num_blocks_needed must be an int >= 0, got {num_blocks_needed!r}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgument(f"block_size must be an int > 0, got {block_size!r}")
    if not candidates:
        raise Unavailable("no live cache node to place a sequence on")
    if len({c.node_id for c in candidates}) != len(candidates):
        raise InvalidArgument("candidates must have distinct node ids")

    scores: dict[str, float] = {}
    rejected: list[str] = []
    best: tuple[tuple[float, str], str] | None = None
    for c in candidates:
        cached = min(c.cached_blocks, num_blocks_needed)
        new = num_blocks_needed - cached
        if new > c.free_blocks:
            rejected.append(c.node_id)
            continue
        load = (c.used_blocks + new) / c.total_blocks if c.total_blocks else 1.0
        score = weights.overlap_weight * cached - weights.load_weight * load
        scores[c.node_id] = score
        rank = (-score, tie_rank(tie_key, c.node_id))  # deterministic across replicas
        if best is None or rank < best[0]:
            best = (rank, c.node_id)

    if best is None:
        need = min(num_blocks_needed - min(c.cached_blocks, num_blocks_needed) for c in candidates)
        raise no_room(num_blocks_needed, need, max(c.free_blocks for c in candidates))
    chosen = next(c for c in candidates if c.node_id == best[1])
    cached = min(chosen.cached_blocks, num_blocks_needed)
    return Placement(
        node_id=chosen.node_id,
        cached_blocks=cached,
        cached_tokens=cached * block_size,
        new_blocks=num_blocks_needed - cached,
        scores=scores,
        rejected=tuple(sorted(rejected)),
    )


def tie_rank(tie_key: bytes, node_id: str) -> str:
    """The rendezvous rank of node_id for tie_key (smaller wins a tie); the Redis
    store's Lua port computes the same with redis.sha1hex."""
    return hashlib.sha1(tie_key + node_id.encode()).hexdigest()


def no_room(num_blocks_needed: int, fewest_uncached: int, most_free: int) -> CapacityExceeded:
    """place()'s error when no candidate has room (the Redis store's Lua port raises the same)."""
    return CapacityExceeded(
        f"no node can hold a {num_blocks_needed}-block sequence (fewest uncached blocks on any node)",
        requested=fewest_uncached,
        available=most_free,
    )
