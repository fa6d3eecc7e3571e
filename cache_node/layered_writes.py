"""Blocks filled at layer 0 of a layer-by-layer write, kept unfindable until the last layer.

attend_decode / attend_prefill with new K/V write one layer per call. A block filled at
layer 0 gets its key only once every layer is written: until then no prefix hit, no STORED
event, so no other sequence reads a block whose later layers are not written yet. A step
left unfinished (a new layer 0 before the last layer, a free, a swap out) is never published.
The engine's lock is held for every call.
"""

from __future__ import annotations

from collections.abc import Callable

from .kv_manager import HeldBlocks, KVCacheManager, Slots


class LayeredWrites:
    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._held: dict[str, list[HeldBlocks]] = {}  # seq id -> blocks filled, not yet published

    def reserve(self, manager: KVCacheManager, ids: list[str], reserve: Callable[[], Slots]) -> Slots:
        """reserve() at layer 0, its filled blocks held back until publish(ids)."""
        if self._num_layers == 1:
            return reserve()
        held_by = self._held
        if held_by:
            for sid in ids:
                held_by.pop(sid, None)
        manager.hold_publish = True
        try:
            return reserve()
        finally:
            manager.hold_publish = False
            for h in manager.take_held():
                held_by.setdefault(h.seq.seq_id, []).append(h)

    def publish(self, manager: KVCacheManager, ids: list[str]) -> None:
        """The last layer of ids is written: their held blocks become findable."""
        held_by = self._held
        if held_by:
            for sid in ids:
                held = held_by.pop(sid, None)
                if held:
                    manager.publish_held(held)

    def drop(self, seq_id: str) -> None:
        """seq_id's unfinished step is abandoned (freed or swapped out): never published."""
        self._held.pop(seq_id, None)

    def clear(self) -> None:
        self._held.clear()
