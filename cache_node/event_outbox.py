"""EventOutbox: a node's block events between its engine and the coordinator's store.

Events are numbered 1, 2, ... per registration and kept, in order, until a reply says the
store holds them (applied_seq). The coordinator queues what a report brings and applies
it later, in batches; its reply says how far it queued (next_seq), which is where the next
report starts: after the last event it took, or earlier after a failed send or when a
restarted coordinator lacks what was queued before it died. Events sent and not yet known
applied are asked about again after `sync_after_s` (an empty report), unless the
node's beats ask (`is_acked_by_beats`: reports sent one-way, which get no reply; a beat's
reply settles them, and one from a restarted coordinator asks for them again). Not
thread-safe: the link's thread owns it.
"""

from __future__ import annotations

import time
from typing import Any


class EventOutbox:
    def __init__(self, sync_after_s: float = 0.05) -> None:
        self.sync_after_s = sync_after_s
        self.pending: list[Any] = []  # the events not known applied, numbered from `first`
        self.first = 1
        self.sent = 0  # the coordinator queued through here, as far as its last reply said
        self._asked_at = 0.0  # when a reply last said how far the store got
        # Reports go one-way and the beats say how far they got: no empty reports to ask
        self.is_acked_by_beats = False

    @property
    def last(self) -> int:
        """The number of the newest event (first - 1 when none waits)."""
        return self.first + len(self.pending) - 1

    def restart(self) -> None:
        """A new registration: its events are numbered from 1; the old ones are moot."""
        self.pending.clear()
        self.first, self.sent = 1, 0

    def add(self, events: list[Any]) -> None:
        self.pending.extend(events)

    def is_due(self) -> bool:
        """Events to send, or sent a while ago and not yet known applied."""
        if self.sent < self.last:
            return True
        if self.is_acked_by_beats:
            return False
        return bool(self.pending) and time.monotonic() - self._asked_at >= self.sync_after_s

    def mark_sent(self) -> None:
        """The report to_send() made went out one-way: count it queued until a beat's
        reply says otherwise (settle)."""
        self.sent = self.last

    def to_send(self) -> tuple[int, int, list[Any]]:
        """(first_seq, base_seq, events) of the next report: from where the coordinator
        queued to the newest; base_seq: the events forgotten (known applied) end there."""
        start = max(self.sent + 1, self.first)
        return start, self.first - 1, self.pending[start - self.first :]

    def settle(self, applied: int, next_seq: int) -> None:
        """A reply: forget what the store holds; send from next_seq on (0: an older
        coordinator, which applied what it was sent before it answered)."""
        self._asked_at = time.monotonic()
        last = self.last
        if not next_seq:
            applied, next_seq = last, last + 1
        self.sent = next_seq - 1
        done = min(applied, last) - self.first + 1
        if done > 0:
            del self.pending[:done]
            self.first += done
        # What the store holds is never sent again (a replica that lags says an earlier next_seq;
        # the next report's base_seq moves it on)
        self.sent = max(self.sent, self.first - 1)
