"""BlockPool: the bookkeeping of one tier of blocks (device or host).

No tensors: it decides which block ids hold what; the engine moves the
bytes. The state is Python lists and dicts; with the LRU policy the hot loops
(take, free) run in C (csrc/block_core.c, built at first use; block_core.py)
on those same objects, with the Python loops below as the fallback and the
reference (tests/unit/test_block_core.py runs both side by side). One
structure serves as free list and cache (lazy eviction):

    state of a block     refcount   key      where it is listed
    ---------------------------------------------------------------
    free                 0          None     _free (a stack)
    cached, evictable    0          set      the eviction policy
    cached, pinned       0          set      _pins (and nowhere else)
    used                 > 0        any      the block tables of its owners

A freed block that has a key stays cached and can be revived by a later
prefix hit until the policy evicts it. Allocation takes never-keyed blocks
first, then evicts. Every operation is O(1) (O(log n) for heap policies).

Not thread-safe by itself: the engine holds one lock around every call.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from itertools import islice
from typing import NamedTuple

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
        if num_blocks < 0:
            raise InvalidArgument(f"{tier} pool size must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
        self.policy = policy if policy is not None else LRUPolicy(native)
        self.refcount = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.block_of_key: dict[bytes, int] = {}
        self.pins: dict[int, int] = {}  # block -> pin count
        self.policy.bind_keys(self.key_of)
        # Pop from the end: block 0 is handed out first, which keeps tests' ids readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.num_evictions = 0
        # With plain LRU (the default and the hot case) the pool works on the
        # policy's order (an OrderedDict, or block_core's LRU) directly: the same
        # order, without a Python call per block. Other policies go through their methods.
        self._lru: MutableMapping[int, None] | None = (
            self.policy._order if type(self.policy) is LRUPolicy else None  # type: ignore[attr-defined]
        )
        # The compiled loops (LRU only; None: the Python loops). `native=False` forces Python.
        self._c = get_core()[0] if native and self._lru is not None else None

    # -- queries (never mutate) -------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no key and no reference."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self.policy)

    @property
    def num_cached(self) -> int:
        """Keyed blocks nobody references (evictable or pinned)."""
        return len(self.policy) + sum(1 for b in self.pins if self.refcount[b] == 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    def lookup(self, key: bytes) -> int | None:
        return self.block_of_key.get(key)

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
        free = self._free
        nfree = len(free)
        c = self._c
        if c is not None:  # the same steps in C
            if n > nfree:
                available = nfree + len(self._lru)  # type: ignore[arg-type]
                if n > available:
                    raise CapacityExceeded(f"{self.tier} pool", n, available)
                self.num_evictions += n - nfree
            return c.take(free, self.refcount, n, self.key_of, self.block_of_key, self._lru, evicted_keys)  # type: ignore[no-any-return]
        refcount = self.refcount
        if n <= nfree:  # no eviction: the usual case
            if n <= 0:
                return []
            out = free[nfree - n :]
            del free[nfree - n :]
            out.reverse()  # the order n pops would give
        else:
            policy = self.policy
            if n > nfree + len(policy):
                raise CapacityExceeded(f"{self.tier} pool", n, nfree + len(policy))
            out = free[::-1]
            del free[:]
            key_of, block_of_key, lru = self.key_of, self.block_of_key, self._lru
            k = n - nfree
            if lru is not None:  # the k oldest
                victims = list(islice(lru, k))
            else:
                victims = [policy.pop_victim() for _ in range(k)]
                for block in victims:
                    policy.forget(block)
            add_key = evicted_keys.append
            for block in victims:
                if lru is not None:
                    del lru[block]
                key = key_of[block]
                assert key is not None
                del block_of_key[key]
                key_of[block] = None
                add_key(key)
            out += victims
            self.num_evictions += k
        # A plain loop: STORE_SUBSCR beats map(refcount.__setitem__, ...) ~3x on CPython 3.11.
        for block in out:
            refcount[block] = 1
        return out

    def allocate_one(self) -> tuple[int, Evicted | None]:
        """allocate(1) without the lists, for the decode path."""
        block, key = self.take_one()
        return block, (None if key is None else Evicted(block, key))

    def take_one(self) -> tuple[int, bytes | None]:
        """allocate(1) as (block, key it was evicted from, or None if it was free)."""
        free = self._free
        if free:
            block = free.pop()
            self.refcount[block] = 1
            return block, None
        lru = self._lru
        if lru is not None and lru:
            block = lru.popitem(last=False)[0]  # type: ignore[call-arg]
        elif lru is None and len(self.policy):
            block = self.policy.pop_victim()
            self.policy.forget(block)
        else:
            raise CapacityExceeded(f"{self.tier} pool", 1, 0)
        key = self.key_of[block]
        assert key is not None
        del self.block_of_key[key]
        self.key_of[block] = None
        self.num_evictions += 1
        self.refcount[block] = 1
        return block, key

    def incref(self, block: int) -> None:
        """Add a reference; revives a cached block (it stops being evictable)."""
        if self.refcount[block] == 0 and block in self.policy:
            self.policy.remove(block)
        self.refcount[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in order. A block that reaches 0
        becomes cached (if keyed) or free. Callers pass a sequence's blocks
        tail-first, so with LRU its deepest blocks are evicted before its prefix."""
        c = self._c
        if c is not None:
            self._raise_if_bad(
                c.release(blocks, False, self.refcount, self.key_of, self.pins, self._free, self._lru)
            )
            return
        refcount, key_of, pins, free = self.refcount, self.key_of, self.pins, self._free
        lru = self._lru
        policy = self.policy
        for block in blocks:
            rc = refcount[block] - 1
            if rc:
                if rc < 0:
                    raise IntegrityError(f"{self.tier} block {block} freed more often than referenced")
                refcount[block] = rc
                continue
            refcount[block] = 0
            if key_of[block] is None:
                if lru is None:
                    policy.forget(block)
                free.append(block)
            elif block not in pins:
                if lru is not None:
                    lru[block] = None
                else:
                    policy.add(block)

    def free_tail_first(self, table: list[int]) -> None:
        """free(table[::-1]) without the copy: a sequence's release."""
        c = self._c
        if c is not None:
            bad = c.release(table, True, self.refcount, self.key_of, self.pins, self._free, self._lru)
            if bad is not None:
                self._raise_if_bad(bad)
        else:
            self.free(table[::-1])

    def _raise_if_bad(self, block: int | None) -> None:
        if block is not None:  # what the Python loop raises at that block, the ones before it released
            raise IntegrityError(f"{self.tier} block {block} freed more often than referenced")

    # -- keys -------------------------------------------------------------------

    def publish(self, block: int, key: bytes) -> bool:
        """Give a full block its key so later prefixes can hit it. Returns False
        (and changes nothing) when the block already has a key or another block
        holds this key: that block keeps serving hits, this one stays private."""
        if self.key_of[block] is not None or key in self.block_of_key:
            return False
        self.key_of[block] = key
        self.block_of_key[key] = block
        return True

    def drop(self, block: int) -> bytes | None:
        """Remove an unreferenced cached block's key and make it free (e.g. it
        moved to another tier). Returns the key it had. Unpinned blocks only."""
        if self.refcount[block] != 0 or block in self.pins:
            raise IntegrityError(f"{self.tier} block {block} is referenced or pinned; cannot drop")
        key = self.key_of[block]
        if key is not None:
            if block in self.policy:
                self.policy.remove(block)
            del self.block_of_key[key]
            self.key_of[block] = None
            self.policy.forget(block)
            self._free.append(block)
        return key

    # -- pins -------------------------------------------------------------------

    def pin(self, block: int) -> None:
        """Keyed blocks only. A pinned block is never evicted, referenced or not."""
        if self.key_of[block] is None:
            raise InvalidArgument(f"{self.tier} block {block} has no key; only cached prefixes can be pinned")
        count = self.pins.get(block, 0)
        if count == 0 and block in self.policy:
            self.policy.remove(block)
        self.pins[block] = count + 1

    def unpin(self, block: int) -> None:
        count = self.pins.get(block, 0)
        if count == 0:
            raise InvalidArgument(f"{self.tier} block {block} is not pinned")
        if count == 1:
            del self.pins[block]
            if self.refcount[block] == 0:
                self.policy.add(block)
        else:
            self.pins[block] = count - 1

    # -- invariants -------------------------------------------------------------

    def check_integrity(self, references: dict[int, int]) -> None:
        """Raise IntegrityError naming the numbers that disagree.

        `references` counts, per block, the block-table entries that point at it
        (the pool cannot see tables; the engine counts them).
        """
        problems: list[str] = []
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            problems.append(f"free list has duplicates ({len(self._free)} entries, {len(free_set)} distinct)")
        used = [b for b in range(self.num_blocks) if self.refcount[b] > 0]
        cached = [b for b in range(self.num_blocks) if self.refcount[b] == 0 and self.key_of[b] is not None]
        if len(free_set) + len(cached) + len(used) != self.num_blocks:
            problems.append(
                f"free {len(free_set)} + cached {len(cached)} + used {len(used)} != total {self.num_blocks}"
            )
        for b in range(self.num_blocks):
            rc, refs = self.refcount[b], references.get(b, 0)
            if rc != refs:
                problems.append(f"block {b}: refcount {rc} != {refs} block-table references")
            if rc == 0 and self.key_of[b] is None and b not in free_set:
                problems.append(f"block {b}: unreferenced, unkeyed, but not on the free list")
            if b in free_set and (rc != 0 or self.key_of[b] is not None):
                problems.append(f"block {b}: on the free list but refcount {rc}, key {self.key_of[b]!r}")
            evictable = rc == 0 and self.key_of[b] is not None and b not in self.pins
            if evictable != (b in self.policy):
                problems.append(f"block {b}: evictable={evictable} but in policy={b in self.policy}")
        num_keyed = sum(1 for k in self.key_of if k is not None)
        if len(self.block_of_key) != num_keyed:
            problems.append(f"{len(self.block_of_key)} keys map to blocks, but {num_keyed} blocks have keys")
        for key, b in self.block_of_key.items():
            if self.key_of[b] != key:
                problems.append(f"key {key.hex()} -> block {b}, whose key is {self.key_of[b]!r}")
        for b in self.pins:
            if self.key_of[b] is None:
                problems.append(f"pinned block {b} has no key")
        if problems:
            raise IntegrityError(f"{self.tier} pool integrity: " + "; ".join(problems[:10]))
