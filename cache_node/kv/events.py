"""The node's block events: which keys it now holds on its device (STORED), holds on its host
tier only (OFFLOADED) or no longer holds (REMOVED),
queued in order for the node to drain and stream to the coordinator's prefix index.

Recorded as two aligned lists (no tuple per event on the hot paths, a block's worth of
keys added in one extend); take() builds BlockEvents, take_batch() hands the lists over.
"""

from __future__ import annotations

from itertools import repeat

from .sequence import OFFLOADED, REMOVED, STORED, BlockEvent, EventBatch

_NO_EVENTS = EventBatch((), ())
_new_tuple = tuple.__new__  # _new_tuple(BlockEvent, (kind, key)): a BlockEvent without a Python frame


def _as_events(kinds: list[str], keys: list[bytes]) -> list[BlockEvent]:
    """Aligned kinds and keys -> [BlockEvent(kind, key), ...], in one C-level pass."""
    return list(map(_new_tuple, repeat(BlockEvent, len(keys)), zip(kinds, keys, strict=True)))


class EventLog:
    """Events since the last drain; with `is_recording` False every record is a no-op."""

    def __init__(self, is_recording: bool) -> None:
        self.is_recording = is_recording
        self._kinds: list[str] = []
        self._keys: list[bytes] = []

    def stored(self, keys: list[bytes]) -> None:
        if self.is_recording and keys:
            self._kinds += [STORED] * len(keys)
            self._keys += keys

    def stored_one(self, key: bytes) -> None:
        if self.is_recording:
            self._kinds.append(STORED)
            self._keys.append(key)

    def offloaded(self, key: bytes) -> None:
        if self.is_recording:
            self._kinds.append(OFFLOADED)
            self._keys.append(key)

    def removed(self, keys: list[bytes]) -> None:
        if self.is_recording and keys:
            self._kinds += [REMOVED] * len(keys)
            self._keys += keys

    def take(self) -> list[BlockEvent]:
        """Drain the events recorded since the last drain, in order."""
        kinds, keys = self._kinds, self._keys
        self._kinds, self._keys = [], []
        return _as_events(kinds, keys)

    def take_batch(self) -> EventBatch:
        """take() without a tuple per event: the two recorded lists themselves."""
        if not self._kinds:  # most decode steps (every one without prefix caching)
            return _NO_EVENTS
        batch = _new_tuple(EventBatch, (self._kinds, self._keys))  # no Python-level __new__
        self._kinds, self._keys = [], []
        return batch  # type: ignore[no-any-return]

    def __len__(self) -> int:
        """Events a drain would return now (a length read: no copy)."""
        return len(self._kinds)

    def pending(self) -> list[BlockEvent]:
        """The events a drain would return now. Changes nothing."""
        return _as_events(self._kinds, self._keys)
