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
- `native_order()`  the compiled order the pool's C loops drive directly, or None (the
                   default): then the pool calls the methods above. A policy written in
                   Python needs nothing more than those methods.

The shipped policies (LRU, LFU, score, SLRU) keep their order in an object with the
methods above: a compiled one from block_core (csrc/order_*.c) when it is available,
else the Python reference classes at the end of this file, which the compiled orders
are tested against step by step (tests/unit/test_block_core*.py). `native=False` forces
the reference.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

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

    def native_order(self) -> Any | None:
        """The compiled order (a block_core Order) that holds this policy's state, for the pool's
        C loops to drive without calling the methods above; None (the default) when there is none.
        Every method of a policy that returns one must act on that order alone."""
        return None

    def victims_in_order(self) -> list[int]:
        """The evictable blocks in the order they would be evicted. O(n log n); for tests and tools."""
        raise NotImplementedError


class OrderPolicy(EvictionPolicy):
    """A policy whose state is one order object with the policy's methods: a compiled order
    (native_order() returns it, so the pool's C loops drive it) or a Python reference order."""

    def __init__(self, order: Any) -> None:
        core = get_core()[0]
        self._order = order
        self._native = order if core is not None and isinstance(order, core.Order) else None

    def add(self, block: int) -> None:
        self._order.add(block)

    def remove(self, block: int) -> None:
        self._order.remove(block)

    def pop_victim(self) -> int:
        return self._order.pop_victim()  # type: ignore[no-any-return]

    def touch(self, block: int) -> None:
        self._order.touch(block)

    def forget(self, block: int) -> None:
        self._order.forget(block)

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._order.bind_keys(key_of)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def victims_in_order(self) -> list[int]:
        return self._order.victims_in_order()  # type: ignore[no-any-return]

    def native_order(self) -> Any | None:
        return self._native


def _compiled(native: bool) -> Any | None:
    return get_core()[0] if native else None


class LRUPolicy(OrderPolicy):
    """Least recently released first: a linked list over block ids (compiled), or an
    OrderedDict (the reference), either giving O(1) removal from the middle, which a
    revived block needs (a deque would be O(n))."""

    name = "lru"

    def __init__(self, native: bool = True) -> None:
        core = _compiled(native)
        super().__init__(core.LRUOrder() if core is not None else PythonLRU())


class LFUPolicy(OrderPolicy):
    """Least frequently used first (uses = allocation + every prefix hit), LRU among equals."""

    name = "lfu"

    def __init__(self, num_blocks: int = 0, native: bool = True) -> None:
        core = _compiled(native)
        order = core.HeapOrder(num_blocks, 1.0, 1.0) if core is not None else PythonWeighted(1, 1)
        super().__init__(order)


class ScorePolicy(OrderPolicy):
    """Least accumulated attention mass first (H2O's heavy-hitter idea applied to
    cached blocks). The node computes attention itself, so it has the per-block
    probability mass that fused kernels hide. Blocks never attended score 0."""

    name = "score"

    def __init__(self, num_blocks: int = 0, native: bool = True) -> None:
        core = _compiled(native)
        if core is not None:
            order = core.HeapOrder(num_blocks, 0.0, 0.0)
            # The compiled weights themselves, so the engine credits a whole batch in one np.add.at.
            self.mass = np.frombuffer(order, dtype=np.float64)[:num_blocks]
        else:
            order = PythonWeighted(0, 0, np.zeros(num_blocks, dtype=np.float64))
            self.mass = order.weights  # type: ignore[assignment]
        super().__init__(order)

    def add_mass(self, block: int, mass: float) -> None:
        self.mass[block] += mass

    def add_mass_many(self, blocks: np.ndarray, masses: np.ndarray) -> None:
        np.add.at(self.mass, blocks, masses)


class SLRUPolicy(OrderPolicy):
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
        core = _compiled(native)
        order = (
            core.SLRUOrder(num_blocks, protected_share)
            if core is not None
            else PythonSLRU(num_blocks, protected_share)
        )
        super().__init__(order)

    def segment_of(self, block: int) -> str | None:
        """'probation', 'protected', or None when the block is not evictable. Changes nothing."""
        return self._order.segment_of(block)  # type: ignore[no-any-return]


class HeapPolicy(EvictionPolicy):
    """Evicts the lowest `_priority(block)` first, ties by release order (oldest first); the
    base of any Python policy that ranks blocks by a number (the reference of the compiled
    weighted order, and bench.hitrate's offline optimum).

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


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "score": ScorePolicy,
    "slru": SLRUPolicy,
}


def make_policy(name: str | EvictionPolicy, num_blocks: int, *, native: bool = True) -> EvictionPolicy:
    """A policy by name, or `name` itself when it is already a policy (benchmarks plug in their own,
    e.g. the offline optimum). `native=False`: the Python reference order even when the compiled
    orders are available (what they are tested against)."""
    if isinstance(name, EvictionPolicy):
        return name
    if name not in POLICIES:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "lru":
        return LRUPolicy(native)
    if name == "slru":
        return SLRUPolicy(num_blocks, native=native)
    return (ScorePolicy if name == "score" else LFUPolicy)(num_blocks, native=native)


# -- the Python reference orders: what the compiled ones (csrc/order_*.c) do, step for step --


class PythonLRU:
    """LRUOrder's reference: an OrderedDict, oldest first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        self._order[block] = None  # a listed block keeps its place

    def remove(self, block: int) -> None:
        del self._order[block]

    def pop_victim(self) -> int:
        if not self._order:
            raise IndexError("no evictable block")
        return self._order.popitem(last=False)[0]

    def touch(self, block: int) -> None:
        pass

    def forget(self, block: int) -> None:
        pass

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        pass

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def victims_in_order(self) -> list[int]:
        return list(self._order)


class PythonSLRU(PythonLRU):
    """SLRUOrder's reference (see SLRUPolicy): probation and protected OrderedDicts, a hit flag
    per block, and the ghost list of recently evicted keys."""

    def __init__(self, num_blocks: int, protected_share: float) -> None:
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._is_hit = bytearray(num_blocks)  # hit since it last entered the evictable set
        self._share = protected_share
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._ghost_size = num_blocks
        self._key_of: list[bytes | None] = []

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        self._key_of = key_of

    def _key(self, block: int) -> bytes | None:
        return self._key_of[block] if block < len(self._key_of) else None

    def add(self, block: int) -> None:
        if block in self:
            return
        if block < len(self._is_hit) and self._is_hit[block]:
            self._protected[block] = None
            return
        key = self._key(block)
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

    def forget(self, block: int) -> None:
        if block < len(self._is_hit):
            self._is_hit[block] = 0

    def pop_victim(self) -> int:
        probation, protected = self._probation, self._protected
        limit = self._share * (len(probation) + len(protected))
        while len(protected) > limit:  # demote: it must earn protection again
            block = protected.popitem(last=False)[0]
            self.forget(block)
            probation[block] = None
        if probation:
            block = probation.popitem(last=False)[0]
        elif protected:
            block = protected.popitem(last=False)[0]
        else:
            raise IndexError("no evictable block")
        key = self._key(block)
        if key is not None and self._ghost_size:
            ghost = self._ghost
            ghost[key] = None
            if len(ghost) > self._ghost_size:
                ghost.popitem(last=False)
        return block

    def segment_of(self, block: int) -> str | None:
        return "probation" if block in self._probation else "protected" if block in self._protected else None

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, block: int) -> bool:
        return block in self._probation or block in self._protected

    def victims_in_order(self) -> list[int]:
        """Without demotions: probation oldest first, then protected oldest first."""
        return list(self._probation) + list(self._protected)


class PythonWeighted(HeapPolicy):
    """HeapOrder's reference: a block's weight starts at `initial`, touch() adds `step`
    (LFU counts uses), add_mass() adds the mass (score); ranked by the weight at add()."""

    def __init__(self, initial: float, step: float, weights: np.ndarray | None = None) -> None:
        super().__init__()
        self._initial, self._step = initial, step
        self.weights: dict[int, float] | np.ndarray = {} if weights is None else weights

    def _priority(self, block: int) -> float:
        if isinstance(self.weights, dict):
            return self.weights.get(block, self._initial)
        return float(self.weights[block])

    def add(self, block: int) -> None:
        if block not in self:
            super().add(block)

    def touch(self, block: int) -> None:
        if self._step:
            self.weights[block] = self._priority(block) + self._step

    def forget(self, block: int) -> None:
        if isinstance(self.weights, dict):
            self.weights.pop(block, None)
        elif block < len(self.weights):
            self.weights[block] = self._initial

    def bind_keys(self, key_of: list[bytes | None]) -> None:
        pass
