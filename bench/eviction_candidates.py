"""Eviction policies measured against LRU and SLRU in bench.hitrate, not shipped to nodes.

Each is what its paper or anchor ships, adapted to a prefix cache's evictable set (a block
enters when its last holder releases it, leaves when a prefix hit revives it; `touch` is a hit):

- s3fifo    S3-FIFO (Yang et al., SOSP'23; LMCache ships it): a small FIFO (10% of the set)
            that a block must be hit in to reach the main FIFO, a main FIFO where a hit buys
            one more pass (2-bit counters, CLOCK style), a ghost FIFO of evicted keys (as many as
            the pool has blocks) that readmits straight to main.
- arc       ARC (Megiddo & Modha, FAST'03): T1 (not hit since it entered) and T2 (hit) with
            ghosts B1 and B2; a ghost return moves the target size of T1 towards the list
            that would have kept it.
- wtinylfu  W-TinyLFU (Einziger et al., Caffeine): a 1% LRU window, then an SLRU main whose
            admission compares the window's victim with main's by access frequency (a counter
            per key, halved every 10x the pool's accesses).
- deadpred  an online dead-block predictor (this repo's, issue #19): it learns from what the
            cache sees which releases are wanted again (see DeadPredPolicy) and evicts the blocks
            least likely to be, in a virtual time that ages every prediction out.
- deadfirst an oracle, not an online policy: LRU that first evicts blocks whose key is never
            wanted again (the replay tells it), so it bounds what perfect dead-block prediction
            (a conversation's last turn, a one-shot document) would give LRU.

- turnoracle deadpred told each request's true turn number in its conversation and, per turn,
            the share of conversations that end there (the workload's own, in hindsight): what
            knowing a conversation's turn count would give that ranking.

They are pure Python (OrderedDicts, heaps), so their speed says nothing; their hit rates are what
bench.hitrate compares (bench/README, "Eviction policies").
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict, deque
from collections.abc import Hashable

from pagedkv.cache_node.eviction import EvictionPolicy, HeapPolicy


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, small_share: float = 0.1) -> None:
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._in_main: set[int] = set()
        self._share = small_share
        self._key_of: list[bytes | None] = []

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def add(self, block: int) -> None:
        key = self._key_of[block]
        if block in self._in_main:
            self._main[block] = None
        elif key is not None and self._ghost.pop(key, 0) is None:  # back from the ghost FIFO
            self._main[block] = None
            self._in_main.add(block)
        else:
            self._small[block] = None

    def remove(self, block: int) -> None:
        if block in self._small:
            del self._small[block]
        else:
            del self._main[block]

    def touch(self, block: int) -> None:
        self._freq[block] = min(self._freq.get(block, 0) + 1, 3)

    def forget(self, block: int) -> None:
        self._freq.pop(block, None)
        self._in_main.discard(block)

    def pop_victim(self) -> int:
        if not self._small and not self._main:
            raise IndexError("no evictable block")
        while True:
            n = len(self._small) + len(self._main)
            if self._small and (len(self._small) > self._share * n or not self._main):
                block = self._small.popitem(last=False)[0]
                if self._freq.get(block, 0):  # hit while small: to main
                    self._freq[block] = 0
                    self._main[block] = None
                    self._in_main.add(block)
                    continue
                return self._evicted(block)
            block = self._main.popitem(last=False)[0]
            if self._freq.get(block, 0):  # one more pass
                self._freq[block] -= 1
                self._main[block] = None
                continue
            return self._evicted(block)

    def _evicted(self, block: int) -> int:
        key = self._key_of[block]
        if key is not None:
            self._ghost[key] = None
            while len(self._ghost) > len(self._key_of):
                self._ghost.popitem(last=False)
        self._in_main.discard(block)
        return block

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block: int) -> bool:
        return block in self._small or block in self._main


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_t1 = 0.0
        self._hit: set[int] = set()
        self._key_of: list[bytes | None] = []

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def add(self, block: int) -> None:
        key = self._key_of[block]
        b1, b2, c = self._b1, self._b2, len(self._key_of)
        if key is not None and key in b1:  # T1 was too small
            self._target_t1 = min(c, self._target_t1 + max(1.0, len(b2) / max(1, len(b1))))
            del b1[key]
            self._t2[block] = None
        elif key is not None and key in b2:  # T2 was too small
            self._target_t1 = max(0.0, self._target_t1 - max(1.0, len(b1) / max(1, len(b2))))
            del b2[key]
            self._t2[block] = None
        elif block in self._hit:
            self._t2[block] = None
        else:
            self._t1[block] = None

    def remove(self, block: int) -> None:
        if block in self._t1:
            del self._t1[block]
        else:
            del self._t2[block]

    def touch(self, block: int) -> None:
        self._hit.add(block)

    def forget(self, block: int) -> None:
        self._hit.discard(block)

    def pop_victim(self) -> int:
        if not self._t1 and not self._t2:
            raise IndexError("no evictable block")
        if self._t1 and (len(self._t1) > self._target_t1 or not self._t2):
            block, ghost = self._t1.popitem(last=False)[0], self._b1
        else:
            block, ghost = self._t2.popitem(last=False)[0], self._b2
        key = self._key_of[block]
        if key is not None:
            ghost[key] = None
            while len(self._b1) + len(self._b2) > len(self._key_of):
                longer = self._b1 if len(self._b1) > self._target_t1 or not self._b2 else self._b2
                longer.popitem(last=False)
        self._hit.discard(block)
        return block

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block: int) -> bool:
        return block in self._t1 or block in self._t2


class WTinyLFUPolicy(EvictionPolicy):
    name = "wtinylfu"

    def __init__(self, window_share: float = 0.01, protected_share: float = 0.8) -> None:
        self._window: OrderedDict[int, None] = OrderedDict()
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._in_main: set[int] = set()
        self._hit: set[int] = set()
        self._freq: dict[bytes, int] = {}
        self._accesses = 0
        self._window_share, self._protected_share = window_share, protected_share
        self._key_of: list[bytes | None] = []

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def _count(self, block: int) -> None:
        key = self._key_of[block]
        if key is None:
            return
        self._freq[key] = self._freq.get(key, 0) + 1
        self._accesses += 1
        if self._accesses >= 10 * max(1, len(self._key_of)):  # age: halve every counter
            self._freq = {k: v // 2 for k, v in self._freq.items() if v > 1}
            self._accesses //= 2

    def _frequency(self, block: int) -> int:
        key = self._key_of[block]
        return self._freq.get(key, 0) if key is not None else 0

    def add(self, block: int) -> None:
        self._count(block)
        if block not in self._in_main:
            self._window[block] = None
        elif block in self._hit:
            self._protected[block] = None
        else:
            self._probation[block] = None
        self._hit.discard(block)

    def remove(self, block: int) -> None:
        for segment in (self._window, self._probation, self._protected):
            if block in segment:
                del segment[block]
                return

    def touch(self, block: int) -> None:
        self._hit.add(block)
        self._count(block)

    def forget(self, block: int) -> None:
        self._in_main.discard(block)
        self._hit.discard(block)

    def pop_victim(self) -> int:
        n = len(self)
        if not n:
            raise IndexError("no evictable block")
        while len(self._protected) > self._protected_share * n:
            self._probation[self._protected.popitem(last=False)[0]] = None
        # Window victims fill main while it is under its share; then each is admitted only
        # against main's victim, by frequency.
        while (
            len(self._window) > self._window_share * n
            and len(self._probation) + len(self._protected) < (1 - self._window_share) * n
        ):
            candidate = self._window.popitem(last=False)[0]
            self._probation[candidate] = None
            self._in_main.add(candidate)
        main = self._probation or self._protected
        if self._window and (len(self._window) > self._window_share * n or not main):
            candidate = self._window.popitem(last=False)[0]
            if not main:
                return self._out(candidate)
            victim = next(iter(main))
            if self._frequency(candidate) > self._frequency(victim):  # admitted: main's victim goes
                del main[victim]
                self._probation[candidate] = None
                self._in_main.add(candidate)
                return self._out(victim)
            return self._out(candidate)
        return self._out(main.popitem(last=False)[0])

    def _out(self, block: int) -> int:
        self._in_main.discard(block)
        self._hit.discard(block)
        return block

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __contains__(self, block: int) -> bool:
        return block in self._window or block in self._probation or block in self._protected


class BeladyPolicy(HeapPolicy):
    """The offline optimum for a known request stream: the evictable block whose key is wanted
    furthest in the future goes first (never-again first of all, LRU order among equals). The
    replay calls `advance(keys)` before each request with the keys that request wants, so the
    next use of every key stays exact (a request that misses a key's parent passes it by too)."""

    name = "belady"

    def __init__(self, wanted: list[list[bytes]]) -> None:
        super().__init__()
        self._uses: dict[bytes, deque[int]] = {}
        for i, keys in enumerate(wanted):
            for key in keys:
                self._uses.setdefault(key, deque()).append(i)
        self._key_of: list[bytes | None] = []

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def _priority(self, block: int) -> float:
        key = self._key_of[block]
        uses = self._uses.get(key) if key is not None else None
        return -(uses[0] if uses else sys.maxsize)

    def advance(self, keys: list[bytes], block_of_key: dict[bytes, int]) -> None:
        """Request i is next: its keys' use i is spent; evictable holders get their new priority."""
        for key in keys:
            uses = self._uses[key]
            uses.popleft()
            block = block_of_key.get(key)
            if block is not None and block in self and self._moves(uses):
                self.add(block)  # a fresh entry; the old one goes stale

    def _moves(self, uses: deque[int]) -> bool:
        """Does a block's priority change once one of its key's uses is spent?"""
        return True


class DeadFirstPolicy(BeladyPolicy):
    """The oracle: blocks whose key no later request wants go first, then LRU. The replay calls
    `advance(keys, block_of_key)` before each request, as for Belady."""

    name = "deadfirst"

    def _priority(self, block: int) -> float:
        key = self._key_of[block]
        return 1.0 if key is not None and self._uses.get(key) else 0.0

    def _moves(self, uses: deque[int]) -> bool:
        return not uses  # now dead: priority 0


class DeadPredPolicy(HeapPolicy):
    """Evicts the blocks least likely to be wanted again, as learned online from the cache's own opens.

    What it observes: each open's full-block keys in prompt order (`observe_open`, which the
    replay calls after the manager's open, as the node's open would), the pool's block -> key
    list, and releases (`add`). Nothing else: no conversation ids, no future.

    A release is labelled by the request that made it, in a bucket: the request's chain depth
    (1 + the depth of the request that first published its deepest known key: a conversation's
    turn number, a one-shot prompt's 1 or 2) for its own blocks, and one class per depth for
    the blocks up to the deepest branch point it passes (a key seen followed by two different
    keys: a shared prefix). A later open that wants any key a release last held marks that
    release alive; p(bucket) = (alive + 1) / (released + 2). Keys are remembered for `memory`
    times the pool's blocks after they were first published (evicted ones too), so a request
    that comes back after its blocks were evicted still teaches the predictor.

    Rank: a block's release is placed at virtual time now + gap * logit(p), clamped to
    +-`clamp`, where gap is the mean number of requests between a release and its first reuse
    (the posterior that a block is alive after waiting falls as exp(-age / gap) for memoryless
    returns, so that order is the posterior's order; 50 requests is the prior gap); the earliest
    virtual time goes first, release order among equals. LRU is the special case p constant.
    """

    name = "deadpred"

    def __init__(self, clamp: float = 4.0, memory: int = 8) -> None:
        super().__init__()
        self._clamp, self._memory = clamp, memory
        self._key_of: list[bytes | None] = []
        self._creator: OrderedDict[bytes, int] = OrderedDict()  # key -> request that published it
        self._holder: dict[bytes, int] = {}  # key -> label of the latest release that held it
        self._child: dict[bytes, bytes] = {}  # key -> the first key seen after it
        self._branch: set[bytes] = set()  # keys seen followed by two different keys
        self._depth: list[int] = []  # per request
        self._labels: list[tuple[Hashable, int, bool]] = []  # (bucket, opened at, wanted again)
        self._alive: dict[Hashable, int] = {}
        self._released: dict[Hashable, int] = {}
        self._gap_sum, self._gap_n = 0.0, 0
        self._now = 0  # opens so far

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def _bucket(self, depth: int) -> Hashable:
        return min(depth, 16)

    def p(self, bucket: Hashable) -> float:
        """The learned chance that a release in `bucket` is wanted again."""
        return (self._alive.get(bucket, 0) + 1) / (self._released.get(bucket, 0) + 2)

    def _label(self, bucket: Hashable) -> int:
        self._labels.append((bucket, self._now, False))
        self._released[bucket] = self._released.get(bucket, 0) + 1
        return len(self._labels) - 1

    def observe_open(self, keys: list[bytes]) -> None:
        """An open of a prompt whose full blocks have these keys (the node computes them)."""
        self._now += 1
        creator, holder = self._creator, self._holder
        known = 0
        while known < len(keys) and keys[known] in creator:
            known += 1
        for label in {holder[k] for k in keys[:known] if k in holder}:
            bucket, opened, alive = self._labels[label]
            if not alive:
                self._labels[label] = (bucket, opened, True)
                self._alive[bucket] = self._alive.get(bucket, 0) + 1
                self._gap_sum += self._now - opened
                self._gap_n += 1
        depth = self._depth[creator[keys[known - 1]]] + 1 if known else 1
        request = len(self._depth)
        self._depth.append(depth)
        shared = 0
        for i in range(min(known, len(keys) - 1)):
            key, after = keys[i], keys[i + 1]
            if key in self._branch or self._child.setdefault(key, after) != after:
                self._branch.add(key)
                shared = i + 1
        own = self._label(self._bucket(depth))
        prefix = self._label(("shared", min(depth, 16))) if shared else own
        for i, key in enumerate(keys):
            holder[key] = prefix if i < shared else own
        for key in keys[known:]:
            creator[key] = request
        while len(creator) > self._memory * max(1, len(self._key_of)):
            key = creator.popitem(last=False)[0]
            holder.pop(key, None)
            self._child.pop(key, None)
            self._branch.discard(key)

    def _priority(self, block: int) -> float:
        key = self._key_of[block]
        label = self._holder.get(key) if key is not None else None
        p = self.p(self._labels[label][0]) if label is not None else 0.5
        logit = max(-self._clamp, min(self._clamp, math.log(p / (1 - p))))
        return self._now + (self._gap_sum + 50.0) / (self._gap_n + 1) * logit


class TurnOraclePolicy(DeadPredPolicy):
    """deadpred whose buckets are the requests' true turn numbers (conversation ids the node does
    not see) and whose p is, per turn, the share of conversations that go on past it (hindsight):
    the most a turn-count predictor could know, under the same ranking."""

    name = "turnoracle"

    def __init__(self, conversations: list[int | None]) -> None:
        super().__init__()
        turns: dict[int, int] = {}
        self._turn: list[int] = []
        for i, c in enumerate(conversations):
            conv = c if c is not None else -1 - i
            turns[conv] = turns.get(conv, 0) + 1
            self._turn.append(turns[conv])
        reached: dict[int, int] = {}
        for n in turns.values():
            for t in range(1, n + 1):
                reached[t] = reached.get(t, 0) + 1
        self._goes_on = {t: reached.get(t + 1, 0) / reached[t] for t in reached}

    def _bucket(self, depth: int) -> Hashable:
        return ("turn", self._turn[self._now - 1])

    def p(self, bucket: Hashable) -> float:
        if isinstance(bucket, tuple) and bucket[0] == "turn":
            assert isinstance(bucket[1], int)
            return min(max(self._goes_on[bucket[1]], 1e-6), 1 - 1e-6)
        return super().p(bucket)


CANDIDATES = {
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "wtinylfu": WTinyLFUPolicy,
    "deadpred": DeadPredPolicy,
}
