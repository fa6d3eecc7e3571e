"""The two tiers: device blocks, and the host tier below them (offload, promotion, swapping).

Every device allocation goes through allocate(): the cached blocks it evicts go down to the
host tier while it has room (the host evicting its own oldest to make room), else out of
the node. A prefix hit on the host tier is promoted back to new device blocks; a whole
sequence can be swapped out to host blocks and back, byte-exact. Bytes move through the
mover at the moment each move is decided, so moves run in decision order (an offload
always reads a device block before anything overwrites it). A close that knows its tail will
not be asked for again drops those cached blocks at once (drop_unheld).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from ...protos.errors import CapacityExceeded
from ..block_pool import BlockPool
from .prefix import PrefixCache
from .sequence import DEVICE, HOST, BlockMover, Counters, Sequence


class Tiers:
    def __init__(
        self, device: BlockPool, host: BlockPool, mover: BlockMover, counters: Counters, prefix: PrefixCache
    ) -> None:
        self.device, self.host, self.mover = device, host, mover
        self.counters, self.prefix = counters, prefix

    def allocate(self, n: int) -> list[int]:
        """n device blocks (refcount 1, no key); what they evict goes to the host tier or out.
        Raises CapacityExceeded, changing nothing, when the device lacks room."""
        evicted_keys: list[bytes] = []
        blocks = self.device.try_take(n, evicted_keys)
        if blocks is None:
            raise CapacityExceeded(f"{self.device.tier} pool", n, self.device.num_available)
        if evicted_keys:
            self.offload(blocks[len(blocks) - len(evicted_keys) :], evicted_keys)
        return blocks

    def offload(self, blocks: list[int], keys: list[bytes]) -> None:
        """Evicted device blocks go to the host tier while it has room, else out."""
        host, counters = self.host, self.counters
        if host.num_blocks == 0:  # no host tier: every evicted key leaves the node
            counters.evicted_device_dropped += len(keys)
            self.prefix.removed(keys)
            return
        for block, key in zip(blocks, keys, strict=True):
            if host.num_available == 0:
                counters.evicted_device_dropped += 1
                self.prefix.removed([key])
                continue
            hb, lost = host.take_one()
            if lost is not None:
                counters.evicted_host_dropped += 1
                self.prefix.removed([lost])
            self.mover.copy_blocks(DEVICE, [block], HOST, [hb])
            host.publish(hb, key)
            host.free([hb])
            counters.evicted_to_host += 1
            self.prefix.events.offloaded(key)  # still held, on the host tier

    def device_room_for(self, dev_hits: list[int]) -> int:
        """Blocks an allocation could take once these device hits are revived. Changes nothing."""
        policy = self.device.policy
        return self.device.num_available - sum(1 for b in dev_hits if b in policy)

    def promote(self, host_blocks: list[int], keys: list[bytes]) -> list[int]:
        """Copy host-cached blocks back to new device blocks (keys move with them)."""
        host = self.host
        for hb in host_blocks:  # hold them so device offloads cannot evict them meanwhile
            host.incref(hb)
        dev_blocks = self.allocate(len(host_blocks))
        self.mover.copy_blocks(HOST, host_blocks, DEVICE, dev_blocks)
        host.free(host_blocks)
        for hb in host_blocks:
            host.drop(hb)
        for db, key in zip(dev_blocks, keys, strict=True):
            self.device.publish(db, key)
        self.prefix.events.stored(keys)  # back on the device
        return dev_blocks

    def check_swap_out(self, seq: Sequence) -> None:
        """Raise CapacityExceeded unless the host tier can hold the whole sequence."""
        n, room = len(seq.table), self.host.num_available
        if n > room:
            raise CapacityExceeded(f"swap out sequence {seq.seq_id!r} to host", n, room)

    def swap_out(self, seq: Sequence) -> int:
        """Move the whole sequence (check_swap_out() passed) to host blocks and free its device
        blocks. Returns the number of blocks moved."""
        host = self.host
        n = len(seq.table)
        host_blocks, lost = host.allocate(n)
        if lost:
            self.counters.evicted_host_dropped += len(lost)
            self.prefix.removed([ev.key for ev in lost])
        self.mover.copy_blocks(DEVICE, seq.table, HOST, host_blocks)
        self.device.free_tail_first(seq.table)
        seq.host_table = host_blocks
        seq.table = []
        self.counters.swap_out_blocks += n
        return n

    def check_swap_in(self, seq: Sequence) -> list[int | None]:
        """For each block of a swapped sequence, the device block still holding its key (revived
        instead of copied) or None; raises CapacityExceeded when the rest does not fit."""
        device = self.device
        revive = [device.lookup(k) if k is not None else None for k in seq.keys]
        need = revive.count(None)
        room = self.device_room_for([b for b in revive if b is not None])
        if need > room:
            raise CapacityExceeded(f"swap in sequence {seq.seq_id!r}", need, max(room, 0))
        return revive

    def swap_in(self, seq: Sequence, revive: list[int | None]) -> int:
        """Bring a swapped sequence back (revive: check_swap_in()'s answer), byte-exact.
        Returns the number of blocks copied."""
        assert seq.host_table is not None
        device = self.device
        for b in revive:
            if b is not None:
                device.incref(b)
        need = revive.count(None)
        fresh = self.allocate(need)
        it = iter(fresh)
        table = [b if b is not None else next(it) for b in revive]
        copy_src = [hb for hb, b in zip(seq.host_table, revive, strict=True) if b is None]
        self.mover.copy_blocks(HOST, copy_src, DEVICE, fresh)
        self.host.free_tail_first(seq.host_table)
        seq.table, seq.host_table = table, None
        self.counters.swap_in_blocks += need
        return need

    def drop_unheld(self, keys: Seq[bytes | None]) -> None:
        """Free now the blocks caching these keys on either tier that nobody holds or pins (a
        swapped sequence's device copies too); REMOVED events for the keys no tier keeps."""
        gone: list[bytes] = []
        for key in keys:
            if key is None:
                continue
            held = dropped = False
            for pool in (self.device, self.host):
                b = pool.lookup(key)
                if b is None:
                    continue
                if pool.refcount_of(b) == 0 and pool.pin_count(b) == 0:
                    pool.drop(b)
                    dropped = True
                else:
                    held = True
            if dropped:
                self.counters.dropped_on_close += 1
                if not held:
                    gone.append(key)
        if gone:
            self.prefix.removed(gone)
