"""Eviction policies for cached blocks (unreferenced, keyed, not pinned).

A policy only orders the evictable set; the pool decides what enters and
leaves it. Each method is O(1) or O(log n). Contract shared by all policies:

- `add(block)`     the block became evictable (its refcount fell to 0). Must not be present.
- `remove(block)`  the block stops being evictable (revived by a hit, pinned, or
                   its key dropped). Must be present.
- `pop_victim()`   removes and returns the block to evict next. Raises IndexError when empty.
- `touch(block)`   the block was used (a prefix hit); policies that count use update here.
                   Safe on any block, evictable or not.
- `add_mass(block, mass)`  attention mass the block received; only the score policy keeps it.
- `forget(block)`  the block's history ends (it was evicted or freed for good).
- `bind_keys(key_of)`  the pool hands over its read-only block -> key list once; only policies
                   that remember evicted keys (SLRU's ghost list) keep it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import MutableMapping

import numpy as np

from ..protos.errors import InvalidArgument
from .block_core import get_core


class EvictionPolicy(ABC):
    name: str = "base"

    @abstractmethod
    def add(self, block: int) -> None: ...

    @abstractmethod
    def remove(self, block: int) -> None: ...

    @abstractmethod
    def pop_victim(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    def touch(self, block: int) -> None:
        """Record a use. Default: nothing (LRU orders by release time)."""

    def add_mass(self, block: int, mass: float) -> None:
        """Record attention mass. Default: ignored."""

    def forget(self, block: int) -> None:
        """Drop per-block history. Default: nothing to drop."""

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        """The pool's block -> key list, read (never written) by policies that track keys. Default: unused."""

    def victims_in_order(self) -> list[int]:
        """The evictable blocks in the order they would be evicted. O(n log n); for tests and tools."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently released first. An OrderedDict gives O(1) removal from the middle,
    which a revived block needs (a deque would be O(n)). With the compiled pool loops
    (block_core.py) the order is their LRU instead: the same operations and results on a
    linked list over block ids in C arrays, which the pool's C loops walk directly;
    `native=False` keeps the OrderedDict."""

    name = "lru"

    def __init__(self, native: bool = True) -> None:
        core = get_core()[0] if native else None
        self._order: MutableMapping[int, None] = OrderedDict() if core is None else core.LRU()

    def add(self, block: int) -> None:
        self._order[block] = None

    def remove(self, block: int) -> None:
        del self._order[block]

    def pop_victim(self) -> int:
        if not self._order:
            raise IndexError("no evictable block")
        return self._order.popitem(last=False)[0]  # type: ignore[call-arg]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def victims_in_order(self) -> list[int]:
        return list(self._order)


class HeapPolicy(EvictionPolicy):
    """Evicts the lowest `_priority(block)` first, ties by release order (oldest first); the
    base of LFU, score and any policy that ranks blocks by a number.

    A heap with lazy deletion: `remove` only forgets the entry's generation, and
    stale entries are skipped when popped. The heap is rebuilt when stale
    entries outnumber live ones, so memory stays O(live).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._live: dict[int, int] = {}  # block -> tick of its live heap entry
        self._tick = itertools.count()

    @abstractmethod
    def _priority(self, block: int) -> float: ...

    def add(self, block: int) -> None:
        tick = next(self._tick)
        self._live[block] = tick
        heapq.heappush(self._heap, (self._priority(block), tick, block))

    def remove(self, block: int) -> None:
        del self._live[block]
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._live):
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def pop_victim(self) -> int:
        heap, live = self._heap, self._live
        while heap:
            _, tick, block = heapq.heappop(heap)
            if live.get(block) == tick:
                del live[block]
                return block
        raise IndexError("no evictable block")

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live

    def victims_in_order(self) -> list[int]:
        return [b for _, t, b in sorted(self._heap) if self._live.get(b) == t]


class LFUPolicy(HeapPolicy):
    """Least frequently used first (uses = allocation + every prefix hit), LRU among equals."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[int, int] = {}

    def _priority(self, block: int) -> float:
        return self._uses.get(block, 1)

    def touch(self, block: int) -> None:
        self._uses[block] = self._uses.get(block, 1) + 1

    def forget(self, block: int) -> None:
        self._uses.pop(block, None)


class ScorePolicy(HeapPolicy):
    """Least accumulated attention mass first (H2O's heavy-hitter idea applied to
    cached blocks). The node computes attention itself, so it has the per-block
    probability mass that fused kernels hide. Blocks never attended score 0."""

    name = "score"

    def __init__(self, num_blocks: int = 0) -> None:
        super().__init__()
        # A dense array so the engine can credit a whole batch in one np.add.at.
        self.mass = np.zeros(num_blocks, dtype=np.float64)

    def _priority(self, block: int) -> float:
        return float(self.mass[block])

    def add_mass(self, block: int, mass: float) -> None:
        self.mass[block] += mass

    def add_mass_many(self, blocks: np.ndarray, masses: np.ndarray) -> None:
        np.add.at(self.mass, blocks, masses)

    def forget(self, block: int) -> None:
        self.mass[block] = 0.0


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU with a ghost list (2Q's A1out): scan resistance for a prefix cache.

    Two LRU segments of the evictable set. A block released after a prefix hit (since it last
    entered the set), or whose key was evicted recently (it is in the ghost list of the last
    `num_blocks` evicted keys), enters *protected*; any other block enters *probation*. Victims
    come from probation's oldest; protected is held to at most `protected_share` of the set by
    moving its oldest to probation's young end (where it must be hit again to come back). So a
    long prompt nobody shares (a scan) passes through probation without flushing the prefixes
    that keep being hit, and one miss after an eviction is enough to keep a key that returns.
    The shares were picked by replaying the trace and the chat workload (bench.hitrate).
    """

    name = "slru"

    def __init__(self, num_blocks: int, protected_share: float = 0.5, native: bool = True) -> None:
        if not 0.0 <= protected_share <= 1.0:
            raise InvalidArgument(f"protected_share must be in [0, 1], got {protected_share}")
        core = get_core()[0] if native else None
        self._probation: MutableMapping[int, None] = OrderedDict() if core is None else core.LRU()
        self._protected: MutableMapping[int, None] = OrderedDict() if core is None else core.LRU()
        self._is_hit = bytearray(num_blocks)  # hit since it last entered the evictable set
        self._share = protected_share
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._ghost_size = num_blocks
        self._key_of: list[bytes | None] = []

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def add(self, block: int) -> None:
        if self._is_hit[block]:
            self._protected[block] = None
            return
        key = self._key_of[block] if block < len(self._key_of) else None
        if key is not None and self._ghost.pop(key, 0) is None:  # evicted recently and back
            self._protected[block] = None
        else:
            self._probation[block] = None

    def remove(self, block: int) -> None:
        if block in self._probation:
            del self._probation[block]
        else:
            del self._protected[block]

    def touch(self, block: int) -> None:
        if block < len(self._is_hit):
            self._is_hit[block] = 1

    def pop_victim(self) -> int:
        probation, protected = self._probation, self._protected
        limit = self._share * (len(probation) + len(protected))
        while len(protected) > limit:  # demote: it must earn protection again
            block = protected.popitem(last=False)[0]  # type: ignore[call-arg]
            self._is_hit[block] = 0
            probation[block] = None
        if probation:
            block = probation.popitem(last=False)[0]  # type: ignore[call-arg]
        elif protected:
            block = protected.popitem(last=False)[0]  # type: ignore[call-arg]
        else:
            raise IndexError("no evictable block")
        key = self._key_of[block] if block < len(self._key_of) else None
        if key is not None and self._ghost_size:
            ghost = self._ghost
            ghost[key] = None
            if len(ghost) > self._ghost_size:
                ghost.popitem(last=False)
        return block

    def forget(self, block: int) -> None:
        if block < len(self._is_hit):
            self._is_hit[block] = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, block: int) -> bool:
        return block in self._probation or block in self._protected

    def victims_in_order(self) -> list[int]:
        """Without demotions: probation oldest first, then protected oldest first."""
        return list(self._probation) + list(self._protected)


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "score": ScorePolicy,
    "slru": SLRUPolicy,
}


def make_policy(name: str | EvictionPolicy, num_blocks: int, *, native: bool = True) -> EvictionPolicy:
    """A policy by name, or `name` itself when it is already a policy (benchmarks plug in their own,
    e.g. the offline optimum). `native=False`: an LRU policy keeps its order in an OrderedDict even
    when the compiled pool loops are available (the reference they are tested against)."""
    if isinstance(name, EvictionPolicy):
        return name
    if name not in POLICIES:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "score":
        return ScorePolicy(num_blocks)
    if name == "slru":
        return SLRUPolicy(num_blocks, native=native)
    return LRUPolicy(native) if name == "lru" else POLICIES[name]()
