"""BlockPool: the bookkeeping of one tier of blocks (device or host).

No tensors: it decides which block ids hold what; the engine moves the bytes.
One structure serves as free list and cache (lazy eviction):

    state of a block     refcount   key      where it is listed
    ---------------------------------------------------------------
    free                 0          None     the free stack
    cached, evictable    0          set      the eviction policy
    cached, pinned       0          set      nowhere (a pin count)
    used                 > 0        any      the block tables of its owners

A freed block that has a key stays cached and can be revived by a later
prefix hit until the policy evicts them. Allocation takes never-keyed blocks
first, then evicts. Every operation is O(1) per block (O(log n) for heap policies).

The per-block state and the loops over it live in a core: the compiled Pool of
block_core (csrc/pool.c), which drives a compiled policy's order without a
Python call per block, or `_PythonCore` below, the reference it is tested
against step by step (tests/unit/test_block_core.py) and the fallback without a
compiler (PAGEDKV_PURE_POOL=1). BlockPool checks arguments, raises the domain
errors and answers the queries; callers use only its methods.

Not thread-safe by itself: the engine holds one lock around every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from ..protos.errors import CapacityExceeded, IntegrityError, InvalidArgument
from .block_core import get_core
from .eviction import EvictionPolicy, LRUPolicy


class Evicted(NamedTuple):
    block: int
    key: bytes


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy | None = None,
        *,
        tier: str = "device",
        native: bool = True,
    ):
        """`native=False` runs the Python reference core even where the compiled one builds."""
        if num_blocks < 0:
            raise InvalidArgument(f"{tier} pool size must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
        self.policy = policy if policy is not None else LRUPolicy(native)
        compiled = get_core()[0] if native else None
        order = self.policy.native_order()
        self._core: Any = (
            compiled.Pool(num_blocks, order if order is not None else self.policy)
            if compiled is not None
            else _PythonCore(num_blocks, self.policy)
        )
        self.is_native = compiled is not None  # the compiled core runs this pool's loops
        self.policy.bind_keys(self._core.key_list)
        # take() for the manager's hot path without a Python frame in between (the core's own
        # method): the same result, or None, changing nothing, when fewer than n are available.
        self.try_take: Callable[[int, list[bytes]], list[int] | None] = self._core.take

    @property
    def compiled_core(self) -> Any | None:
        """The compiled Pool behind this pool (None on the reference core), for compiled code to
        take blocks from directly (a decode group's step); everything else uses the methods below."""
        return self._core if self.is_native else None

    # -- queries (never mutate) -------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no key and no reference."""
        return self._core.num_free  # type: ignore[no-any-return]

    @property
    def num_evictable(self) -> int:
        return self._core.num_evictable  # type: ignore[no-any-return]

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        core = self._core
        return core.num_free + core.num_evictable  # type: ignore[no-any-return]

    @property
    def num_cached(self) -> int:
        """Keyed blocks nobody references (evictable or pinned). O(n)."""
        return self._core.num_evictable + self._core.num_pinned_idle()  # type: ignore[no-any-return]

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted to make room so far."""
        return self._core.num_evictions  # type: ignore[no-any-return]

    def lookup(self, key: bytes) -> int | None:
        return self._core.lookup(key)  # type: ignore[no-any-return]

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest prefix of `keys` held here (stops at the first miss)."""
        return self._core.match(keys)  # type: ignore[no-any-return]

    def key(self, block: int) -> bytes | None:
        return self._core.key(block)  # type: ignore[no-any-return]

    def refcount_of(self, block: int) -> int:
        return self._core.refcount_of(block)  # type: ignore[no-any-return]

    def pin_count(self, block: int) -> int:
        return self._core.pin_count(block)  # type: ignore[no-any-return]

    def num_releasable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (distinct) one free() each would make allocatable."""
        return self._core.num_releasable(blocks)  # type: ignore[no-any-return]

    # Snapshots for tests, tools and integrity checks: O(n) copies (block_of_key: a live read-only view).

    @property
    def refcount(self) -> list[int]:
        return self._core.refcounts()  # type: ignore[no-any-return]

    @property
    def key_of(self) -> list[bytes | None]:
        return list(self._core.key_list)

    @property
    def block_of_key(self) -> Mapping[bytes, int]:
        return MappingProxyType(self._core.key_map)

    @property
    def pins(self) -> dict[int, int]:
        return self._core.pin_counts()  # type: ignore[no-any-return]

    @property
    def free_blocks(self) -> list[int]:
        """The free stack, bottom first (the last is taken next)."""
        return self._core.free_list()  # type: ignore[no-any-return]

    # -- allocation -------------------------------------------------------------

    def allocate(self, n: int) -> tuple[list[int], list[Evicted]]:
        """Take `n` blocks, each with refcount 1 and no key.

        Returns the blocks and the cached blocks evicted to make room (their keys
        are gone from this pool when this returns; a caller with a lower tier can
        copy their bytes there before writing the new ones). Raises
        CapacityExceeded, changing nothing, when fewer than `n` are available.
        """
        evicted_keys: list[bytes] = []
        blocks = self.take(n, evicted_keys)
        victims = blocks[len(blocks) - len(evicted_keys) :]
        return blocks, [Evicted(b, key) for b, key in zip(victims, evicted_keys, strict=True)]

    def take(self, n: int, evicted_keys: list[bytes]) -> list[int]:
        """allocate(n) for the manager's hot path: the keys of the evicted blocks
        are appended to `evicted_keys` (those blocks are the last
        len(evicted_keys) of the result, in eviction order), and no Evicted
        tuple is built per block."""
        blocks = self.try_take(n, evicted_keys)
        if blocks is None:
            raise CapacityExceeded(f"{self.tier} pool", n, self.num_available)
        return blocks

    def allocate_one(self) -> tuple[int, Evicted | None]:
        """allocate(1) without the lists, for the decode path."""
        block, key = self.take_one()
        return block, (None if key is None else Evicted(block, key))

    def take_one(self) -> tuple[int, bytes | None]:
        """allocate(1) as (block, key it was evicted from, or None if it was free)."""
        evicted: list[bytes] = []
        (block,) = self.take(1, evicted)
        return block, (evicted[0] if evicted else None)

    def incref(self, block: int) -> None:
        """Add a reference; revives a cached block (it stops being evictable)."""
        self._core.incref(block)

    def acquire(self, blocks: Sequence[int]) -> None:
        """A prefix hit on cached blocks: incref() each and tell the policy it was used."""
        self._core.acquire(blocks)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in order. A block that reaches 0
        becomes cached (if keyed) or free. Callers pass a sequence's blocks
        tail-first, so with LRU its deepest blocks are evicted before its prefix.
        A block freed more often than referenced raises IntegrityError (the ones
        before it are released)."""
        self.raise_if_overfreed(self._core.release(blocks, False))

    def free_tail_first(self, table: Sequence[int]) -> None:
        """free(table[::-1]) without the copy: a sequence's release."""
        bad = self._core.release(table, True)
        if bad is not None:  # tested here, not in raise_if_overfreed: one call less per release
            self.raise_if_overfreed(bad)

    def raise_if_overfreed(self, block: int | None) -> None:
        """Raise IntegrityError for a block a release found freed more often than referenced."""
        if block is not None:
            raise IntegrityError(f"{self.tier} block {block} freed more often than referenced")

    # -- keys -------------------------------------------------------------------

    def publish(self, block: int, key: bytes) -> bool:
        """Give a full block its key so later prefixes can hit it. Returns False
        (and changes nothing) when the block already has a key or another block
        holds this key: that block keeps serving hits, this one stays private."""
        return self._core.publish(block, key)  # type: ignore[no-any-return]

    def publish_many(self, blocks: Sequence[int], keys: Sequence[bytes]) -> list[bytes]:
        """publish() each (block, key) pair in order; returns the keys that were published."""
        return self._core.publish_many(blocks, keys)  # type: ignore[no-any-return]

    def drop(self, block: int) -> bytes | None:
        """Remove an unreferenced cached block's key and make it free (e.g. it
        moved to another tier). Returns the key it had. Unpinned blocks only."""
        if self._core.refcount_of(block) != 0 or self._core.pin_count(block):
            raise IntegrityError(f"{self.tier} block {block} is referenced or pinned; cannot drop")
        return self._core.drop(block)  # type: ignore[no-any-return]

    # -- pins -------------------------------------------------------------------

    def pin(self, block: int) -> None:
        """Keyed blocks only. A pinned block is never evicted, referenced or not."""
        if not self._core.pin(block):
            raise InvalidArgument(f"{self.tier} block {block} has no key; only cached prefixes can be pinned")

    def unpin(self, block: int) -> None:
        if not self._core.unpin(block):
            raise InvalidArgument(f"{self.tier} block {block} is not pinned")

    # -- invariants -------------------------------------------------------------

    def check_integrity(self, references: dict[int, int]) -> None:
        """Raise IntegrityError naming the numbers that disagree.

        `references` counts, per block, the block-table entries that point at it
        (the pool cannot see tables; the engine counts them).
        """
        problems: list[str] = []
        free, refcount, key_of, pins = self.free_blocks, self.refcount, self.key_of, self.pins
        free_set = set(free)
        if len(free_set) != len(free):
            problems.append(f"free list has duplicates ({len(free)} entries, {len(free_set)} distinct)")
        used = [b for b in range(self.num_blocks) if refcount[b] > 0]
        cached = [b for b in range(self.num_blocks) if refcount[b] == 0 and key_of[b] is not None]
        if len(free_set) + len(cached) + len(used) != self.num_blocks:
            problems.append(
                f"free {len(free_set)} + cached {len(cached)} + used {len(used)} != total {self.num_blocks}"
            )
        num_evictable = 0
        for b in range(self.num_blocks):
            rc, refs = refcount[b], references.get(b, 0)
            if rc != refs:
                problems.append(f"block {b}: refcount {rc} != {refs} block-table references")
            if rc == 0 and key_of[b] is None and b not in free_set:
                problems.append(f"block {b}: unreferenced, unkeyed, but not on the free list")
            if b in free_set and (rc != 0 or key_of[b] is not None):
                problems.append(f"block {b}: on the free list but refcount {rc}, key {key_of[b]!r}")
            evictable = rc == 0 and key_of[b] is not None and b not in pins
            num_evictable += evictable
            if evictable != (b in self.policy):
                problems.append(f"block {b}: evictable={evictable} but in policy={b in self.policy}")
        if num_evictable != len(self.policy):
            problems.append(f"{num_evictable} evictable blocks, but the policy lists {len(self.policy)}")
        num_keyed = sum(1 for k in key_of if k is not None)
        block_of_key = self.block_of_key
        if len(block_of_key) != num_keyed:
            problems.append(f"{len(block_of_key)} keys map to blocks, but {num_keyed} blocks have keys")
        for key, b in block_of_key.items():
            if key_of[b] != key:
                problems.append(f"key {key.hex()} -> block {b}, whose key is {key_of[b]!r}")
        for b in pins:
            if key_of[b] is None:
                problems.append(f"pinned block {b} has no key")
        if problems:
            raise IntegrityError(f"{self.tier} pool integrity: " + "; ".join(problems[:10]))


class _PythonCore:
    """The reference core: what block_core's compiled Pool does (csrc/pool.c), in Python, for
    any policy through its methods. Same methods, results and order of effects; arguments are
    trusted (BlockPool checks them)."""

    def __init__(self, num_blocks: int, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.refcount = [0] * num_blocks
        self.key_list: list[bytes | None] = [None] * num_blocks
        self.key_map: dict[bytes, int] = {}
        self.pins: dict[int, int] = {}  # block -> pin count
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    def take(self, n: int, evicted_keys: list[bytes]) -> list[int] | None:
        if n <= 0:
            return []
        free, policy = self.free, self.policy
        if n > len(free) and n > len(free) + len(policy):
            return None
        from_free = min(n, len(free))
        victims = [policy.pop_victim() for _ in range(n - from_free)]
        for block in victims:
            policy.forget(block)
        for block in victims:
            key = self.key_list[block]
            assert key is not None
            del self.key_map[key]
            evicted_keys.append(key)
            self.key_list[block] = None
            self.num_evictions += 1
        out = free[len(free) - from_free :][::-1] + victims  # the order from_free pops would give
        del free[len(free) - from_free :]
        for block in out:
            self.refcount[block] = 1
        return out

    def release(self, blocks: Sequence[int], reverse: bool) -> int | None:
        refcount, key_list, pins, policy = self.refcount, self.key_list, self.pins, self.policy
        for block in reversed(blocks) if reverse else blocks:
            rc = refcount[block] - 1
            if rc:
                if rc < 0:
                    return block
                refcount[block] = rc
                continue
            refcount[block] = 0
            if key_list[block] is None:
                policy.forget(block)
                self.free.append(block)
            elif block not in pins:
                policy.add(block)
        return None

    def incref(self, block: int) -> None:
        if self.refcount[block] == 0 and block in self.policy:
            self.policy.remove(block)
        self.refcount[block] += 1

    def acquire(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.incref(block)
            self.policy.touch(block)

    def publish(self, block: int, key: bytes) -> bool:
        if self.key_list[block] is not None or key in self.key_map:
            return False
        self.key_list[block] = key
        self.key_map[key] = block
        return True

    def publish_many(self, blocks: Sequence[int], keys: Sequence[bytes]) -> list[bytes]:
        if len(blocks) != len(keys):
            raise ValueError("publish_many: one key per block")
        return [key for block, key in zip(blocks, keys, strict=True) if self.publish(block, key)]

    def drop(self, block: int) -> bytes | None:
        key = self.key_list[block]
        if key is not None:
            if block in self.policy:
                self.policy.remove(block)
            del self.key_map[key]
            self.key_list[block] = None
            self.policy.forget(block)
            self.free.append(block)
        return key

    def lookup(self, key: bytes) -> int | None:
        return self.key_map.get(key)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        out: list[int] = []
        for key in keys:
            block = self.key_map.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def pin(self, block: int) -> bool:
        if self.key_list[block] is None:
            return False
        count = self.pins.get(block, 0)
        if count == 0 and block in self.policy:
            self.policy.remove(block)
        self.pins[block] = count + 1
        return True

    def unpin(self, block: int) -> bool:
        count = self.pins.get(block, 0)
        if count == 0:
            return False
        if count == 1:
            del self.pins[block]
            if self.refcount[block] == 0:
                self.policy.add(block)
        else:
            self.pins[block] = count - 1
        return True

    def refcount_of(self, block: int) -> int:
        return self.refcount[block]

    def pin_count(self, block: int) -> int:
        return self.pins.get(block, 0)

    def key(self, block: int) -> bytes | None:
        return self.key_list[block]

    def num_releasable(self, blocks: Sequence[int]) -> int:
        refcount, key_list, pins = self.refcount, self.key_list, self.pins
        return sum(1 for b in blocks if refcount[b] == 1 and (key_list[b] is None or b not in pins))

    def num_pinned_idle(self) -> int:
        return sum(1 for b in self.pins if self.refcount[b] == 0)

    def refcounts(self) -> list[int]:
        return list(self.refcount)

    def free_list(self) -> list[int]:
        return list(self.free)

    def pin_counts(self) -> dict[int, int]:
        return dict(self.pins)
