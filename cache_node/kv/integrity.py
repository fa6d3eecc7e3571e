"""The manager's invariants, checked from the outside: every table entry is a reference the
pools count, every sequence's lists agree with its length, and the counters the fast paths
rely on (swapped sequences, pins, the decode group) agree with the records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...protos.errors import IntegrityError

if TYPE_CHECKING:
    from ..kv_manager import KVCacheManager


def check_manager(mgr: KVCacheManager) -> None:
    """Raise IntegrityError with the numbers that disagree."""
    dev_refs: dict[int, int] = {}
    host_refs: dict[int, int] = {}
    problems: list[str] = []
    bs = mgr.block_size
    for seq in mgr.seqs.values():
        table, refs = (seq.host_table, host_refs) if seq.host_table is not None else (seq.table, dev_refs)
        for b in table:
            refs[b] = refs.get(b, 0) + 1
        blocks = len(table)
        if blocks != -(-seq.cache_len // bs) or len(seq.keys) != blocks or len(seq.scores) != blocks:
            problems.append(
                f"sequence {seq.seq_id!r}: {blocks} blocks, {len(seq.keys)} keys, "
                f"{len(seq.scores)} scores for cache_len {seq.cache_len}"
            )
    mgr.device.check_integrity(dev_refs)
    mgr.host.check_integrity(host_refs)
    for seq in mgr.seqs.values():
        if seq.simple and seq.host_table is None:  # the decode fast path must be safe for it
            shared_tail = seq.cache_len % bs != 0 and mgr.device.refcount_of(seq.table[-1]) != 1
            if seq.budget is not None or shared_tail:
                problems.append(f"sequence {seq.seq_id!r}: simple, yet has a budget or shared tail")
    mgr.decoder.check(problems)
    num_swapped = sum(1 for s in mgr.seqs.values() if s.host_table is not None)
    if num_swapped != mgr.num_swapped:
        problems.append(f"{num_swapped} sequences swapped out, but {mgr.num_swapped} counted")
    both = mgr.device.block_of_key.keys() & mgr.host.block_of_key.keys()
    if both:
        problems.append(f"{len(both)} keys held by both tiers")
    for key, count in mgr.pinned_keys.items():
        pinned = mgr.device.lookup(key)
        if pinned is None or mgr.device.pin_count(pinned) < count:
            problems.append(f"pinned key {key.hex()} lost its pinned device block")
    if problems:
        raise IntegrityError("; ".join(problems))
