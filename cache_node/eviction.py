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


class _HeapPolicy(EvictionPolicy):
    """Evicts the lowest priority first, ties by release order (oldest first).

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


class LFUPolicy(_HeapPolicy):
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


class ScorePolicy(_HeapPolicy):
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


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy, "score": ScorePolicy}


def make_policy(name: str, num_blocks: int, *, native: bool = True) -> EvictionPolicy:
    """`native=False`: an LRU policy keeps its order in an OrderedDict even when the compiled
    pool loops are available (the reference they are tested against)."""
    if name not in POLICIES:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "score":
        return ScorePolicy(num_blocks)
    return LRUPolicy(native) if name == "lru" else POLICIES[name]()
