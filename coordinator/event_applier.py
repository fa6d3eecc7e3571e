"""EventApplier: nodes' numbered block events, queued as they are reported and applied to
the store in batches, so that a report costs the coordinator no store round trip.

A node numbers its events 1, 2, ... per registration (epoch) and keeps each one until a
reply says the store holds it (`applied`). A report is queued here when it continues what
this coordinator has queued for the node (its first_seq at most one past it; the overlap of
a resend is skipped); one past a gap is refused and answered with where to resend from. The
applier thread nets each node's queued events (each key's last event) into one EventRun and
applies every dirty node's run in one store call: at once after a quiet spell, at most once
per `interval_s` under a stream of reports, so a report reaches the index within a round
trip (a stream's within `interval_s`) and a busy coordinator pays one round trip for many
reports of many nodes: the applier's cost is bounded by its flushes, not by the reports.

Nothing acknowledged is lost: a crash here loses only queued events, which their node still
holds and resends when the next reply (from a restarted coordinator or a replica, which
starts from the store's applied seq) asks for them. The store applies a run only where it
continues what it holds (store.apply_event_runs), so replicas flushing one node's runs in
any order apply them in order, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..protos.errors import InvalidArgument, NodeNotLive, PagedKVError, Unavailable
from ..protos.keys import KEY_BYTES
from ..protos.serving import name_os_thread
from .records import NOT_LIVE, EventRun
from .store import Store

log = logging.getLogger("pagedkv.coordinator.events")
STORED_KIND = 1  # pb.BlockEvent.STORED
OFFLOADED_KIND = 50  # pb.BlockEvent.OFFLOADED: still held, on the node's host tier
MAX_SEQ = (1 << 63) - 1
RETRY_S, MAX_RETRY_S = 0.05, 1.0  # after failed flushes (the store unreachable): doubling pauses


@dataclass(slots=True)
class _NodeLog:
    epoch: int
    applied: int  # the store holds the node's events through here (as this process last heard)
    queued: int  # the last seq queued here (>= applied)
    first: int = 0  # the first seq in `net` (0: nothing waits)
    net: dict[bytes, int] = field(default_factory=dict)  # key -> its last queued event's kind
    is_dead: bool = False  # the store refused a run: not live, or another registration
    base: int = 0  # the node forgot its events through here (the store said it held them)


Applied = Callable[[list[EventRun]], None]


class EventApplier:
    """Queues numbered reports (`offer`) and applies them on its own thread (without
    `background`, when the caller flushes); thread-safe. `on_applied(runs)` runs after each
    flush with the runs the store took whole."""

    def __init__(
        self,
        store: Store,
        on_applied: Applied | None = None,
        *,
        interval_s: float = 0.01,
        max_queued: int = 1 << 20,
        background: bool = True,
    ) -> None:
        self.store = store
        self.on_applied = on_applied
        self.interval_s = interval_s
        self.max_queued = max_queued  # queued (netted) events past which reports are refused (Unavailable)
        self._logs: dict[str, _NodeLog] = {}
        self._dirty: list[str] = []  # nodes with queued events, in the order they came
        self._num_queued = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._is_stopping = not background  # (no thread: the caller flushes)
        self._last_flush = 0.0
        self._failures = 0  # flushes failed in a row
        self.num_flushes = 0
        self.num_applied = 0  # events in runs the store took
        self.num_refused = 0  # reports refused: a gap or a full queue

    # -- the handler's side ----------------------------------------------------------

    def offer(
        self, node_id: str, epoch: int, first_seq: int, events: Sequence[tuple[int, bytes]], base_seq: int = 0
    ) -> tuple[int, int]:
        """Queue a report's events; (applied, next_seq): the node may forget its events
        through `applied`, and sends from `next_seq` on next (earlier than first_seq +
        len(events) when this coordinator lacks what came before). NodeNotLive when the
        node is not live under `epoch`; Unavailable when the queue is full."""
        if not 0 < epoch <= MAX_SEQ:
            raise InvalidArgument(f"epoch must be in [1, 2^63), got {epoch}")
        if first_seq < 1 or first_seq + len(events) - 1 > MAX_SEQ:
            raise InvalidArgument(f"first_seq must be in [1, 2^63 - {len(events)}], got {first_seq}")
        if not 0 <= base_seq < first_seq:
            raise InvalidArgument(f"base_seq must be in [0, first_seq {first_seq}), got {base_seq}")
        for i, (_, key) in enumerate(events):  # (checked here: a flush must not meet a bad key)
            if len(key) != KEY_BYTES:
                raise InvalidArgument(f"event {i}: a {len(key)}-byte key (block keys have {KEY_BYTES})")
        while True:
            with self._lock:  # (the node's log here already, the common case: one lock)
                entry = self._logs.get(node_id)
                if entry is not None and entry.epoch == epoch and not entry.is_dead:
                    return self._queue(node_id, entry, first_seq, events, base_seq)
            if self._load(node_id, epoch).is_dead:
                self.num_refused += 1
                raise NodeNotLive(node_id, "events ignored; register again")
            # loaded (or replaced meanwhile): look again under the lock

    def acknowledge(self, node_id: str, epoch: int) -> tuple[int, int] | None:
        """(applied, next_seq) of the node's events under `epoch`, as offer answers them,
        without a report (a node reporting one-way asks on its beat); None when the node
        is not live under it. Loads the node's log from the store when this process has
        none (a restart: next_seq then asks for what the store lacks). Changes nothing else."""
        if not 0 < epoch <= MAX_SEQ:
            raise InvalidArgument(f"events_epoch must be in [1, 2^63), got {epoch}")
        with self._lock:
            entry = self._logs.get(node_id)
            if entry is not None and entry.epoch == epoch and not entry.is_dead:
                return entry.applied, entry.queued + 1
        entry = self._load(node_id, epoch)
        with self._lock:
            return None if entry.is_dead else (entry.applied, entry.queued + 1)

    def _queue(
        self, node_id: str, entry: _NodeLog, first_seq: int, events: Sequence[tuple[int, bytes]], base: int
    ) -> tuple[int, int]:
        """offer's work on the node's current log, under the lock."""
        if first_seq > max(entry.queued, base) + 1:  # a gap: what came before is not here
            self.num_refused += 1
            return entry.applied, entry.queued + 1
        if base > entry.queued:  # the store held more than this process saw: start after it
            if entry.first:  # (what waits here is older than what the store holds)
                self._num_queued -= len(entry.net)
                self._dirty.remove(node_id)
                entry.first, entry.net = 0, {}
            entry.queued = entry.applied = base
        entry.base = max(entry.base, base)
        fresh = events[entry.queued + 1 - first_seq :]
        if fresh:
            if self._num_queued + len(fresh) > self.max_queued:
                self.num_refused += 1
                raise Unavailable(
                    f"{self._num_queued} block events wait for the store (at most {self.max_queued}): "
                    "it is slow or unreachable; report again later"
                )
            if not entry.first:
                entry.first = entry.queued + 1
                if not self._dirty:
                    self._wake.notify()
                self._dirty.append(node_id)
            net = entry.net
            before = len(net)
            for kind, key in fresh:
                net[key] = kind
            entry.queued += len(fresh)
            self._num_queued += len(net) - before  # (counts what a flush takes: keys, netted)
            self._start()
        return entry.applied, entry.queued + 1

    def _load(self, node_id: str, epoch: int) -> _NodeLog:
        """This process's log of `node_id` under `epoch`, from the store's applied seq."""
        applied = self.store.applied_seq(node_id, epoch)
        with self._lock:
            entry = self._logs.get(node_id)
            if entry is not None and entry.epoch == epoch and not entry.is_dead:
                return entry  # another report of the node loaded it meanwhile
            if entry is not None and entry.first:  # another registration's queue: stale now
                self._num_queued -= len(entry.net)
                self._dirty.remove(node_id)
            entry = _NodeLog(epoch, max(applied, 0), max(applied, 0), is_dead=applied == NOT_LIVE)
            self._logs[node_id] = entry
            return entry

    @property
    def num_queued(self) -> int:
        """Events waiting for the store (each key's last, per node)."""
        return self._num_queued

    def forget(self, node_id: str) -> None:
        """The node left (removed): drop its log and whatever of it waits."""
        with self._lock:
            entry = self._logs.pop(node_id, None)
            if entry is not None and entry.first:
                self._num_queued -= len(entry.net)
                self._dirty.remove(node_id)

    # -- the applier's side ----------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None and not self._is_stopping:
            self._thread = threading.Thread(target=self._run, name="event-applier", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._lock:
                while not self._dirty and not self._is_stopping:
                    self._wake.wait()
                if self._is_stopping and not self._dirty:
                    return
            wait = self._last_flush + self.interval_s - time.monotonic()
            if wait > 0 and not self._is_stopping:  # a stream of reports: gather an interval's worth
                time.sleep(wait)
            self._last_flush = time.monotonic()
            if self.flush():
                self._failures = 0
                continue
            if self._is_stopping:
                return  # one try at stop: the nodes still hold what was queued
            time.sleep(min(RETRY_S * 2**self._failures, MAX_RETRY_S))
            self._failures += 1

    def flush(self) -> bool:
        """Apply everything queued now, in one store call; False when the store failed (the
        events stay queued, ahead of any that came since)."""
        with self._lock:
            dirty, self._dirty = self._dirty, []
            runs: list[tuple[EventRun, _NodeLog, dict[bytes, int]]] = []
            for node_id in dirty:
                entry = self._logs[node_id]
                net, entry.net = entry.net, {}
                runs.append((_run_of(node_id, entry, net), entry, net))
                entry.first = 0
                self._num_queued -= len(net)
        if not runs:
            return True
        try:
            results = self.store.apply_event_runs([run for run, _, _ in runs])
        except InvalidArgument:  # a bug (offer checks what a run holds): drop, let the nodes resend
            log.exception("block events refused by the store (%d runs dropped)", len(runs))
            self._rewind(runs)
            return True
        except PagedKVError as exc:
            if not self._failures:  # (once an outage: the next flush that works ends it)
                log.warning("block events not applied (%d runs, kept to retry): %s", len(runs), exc)
            self._requeue(runs)
            return False
        self.num_flushes += 1
        taken: list[EventRun] = []
        with self._lock:
            for (run, entry, _), applied in zip(runs, results, strict=True):
                if applied >= run.last_seq:
                    if applied > entry.applied:
                        entry.applied = applied
                    self.num_applied += run.last_seq - run.first_seq + 1
                    taken.append(run)
                elif applied == NOT_LIVE:
                    entry.is_dead = True  # its next report answers NodeNotLive (and reloads)
                else:  # the store lacks what came before: resend from there
                    entry.applied = entry.queued = applied
                    if entry.first:
                        self._num_queued -= len(entry.net)
                        self._dirty.remove(run.node_id)
                        entry.first, entry.net = 0, {}
        if self.on_applied is not None and taken:
            self.on_applied(taken)
        return True

    def _rewind(self, runs: list[tuple[EventRun, _NodeLog, dict[bytes, int]]]) -> None:
        """Runs dropped: their nodes' next reports are asked to resend from what the store holds."""
        with self._lock:
            for run, entry, _ in runs:
                if self._logs.get(run.node_id) is entry:
                    entry.is_dead = True  # (reloaded from the store's applied seq at the next report)

    def _requeue(self, runs: list[tuple[EventRun, _NodeLog, dict[bytes, int]]]) -> None:
        """Runs the store did not take back in their logs, before what came since."""
        with self._lock:
            for run, entry, net in runs:
                if self._logs.get(run.node_id) is not entry:
                    continue  # the node left or registered again meanwhile
                merged = dict(net)
                merged.update(entry.net)  # the newer events win
                self._num_queued += len(merged) - len(entry.net)
                if not entry.first:
                    self._dirty.append(run.node_id)
                entry.first, entry.net = run.first_seq, merged

    def stop(self, timeout_s: float = 5.0) -> None:
        """Apply what is queued (one try), then end the thread."""
        with self._lock:
            self._is_stopping = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


def split_net(net: dict[bytes, int]) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(stored, removed, offloaded) of each key's last event kind; an unknown kind counts as
    removed: the index never claims a block it cannot vouch for."""
    stored: list[bytes] = []
    removed: list[bytes] = []
    offloaded: list[bytes] = []
    for key, kind in net.items():
        (stored if kind == STORED_KIND else offloaded if kind == OFFLOADED_KIND else removed).append(key)
    return stored, removed, offloaded


def _run_of(node_id: str, entry: _NodeLog, net: dict[bytes, int]) -> EventRun:
    stored, removed, offloaded = (tuple(keys) for keys in split_net(net))
    return EventRun(node_id, entry.epoch, entry.first, entry.queued, stored, removed, offloaded, entry.base)
