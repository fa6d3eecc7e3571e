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
- deadfirst an oracle, not an online policy: LRU that first evicts blocks whose key is never
            wanted again (the replay tells it), so it bounds what perfect dead-block prediction
            (a conversation's last turn, a one-shot document) would give LRU.

They are pure Python (OrderedDicts), so their speed says nothing; their hit rates are what
bench.hitrate compares. None beat SLRU by more than noise where SLRU beats LRU, and each loses to
LRU by more than 1% somewhere (bench/README, "Eviction policies").
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque

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


CANDIDATES = {"s3fifo": S3FIFOPolicy, "arc": ARCPolicy, "wtinylfu": WTinyLFUPolicy}
