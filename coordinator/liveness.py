"""Liveness: when a node whose lease lapsed is declared dead (the reaper asks here).

A node beats every lease/4; its lease key in the store lapses a lease after the last beat
applied (the lease the coordinator hands out, longer for a large fleet: lease_scale.py). A
lapse makes the node a suspect, never a corpse by itself. It is declared dead only when all of these hold:

1. the store has answered this coordinator for a whole lease without a failure: an
   outage of the store (or of this coordinator) is nobody's death, so after one every
   suspect gets a fresh lease to beat again (its lease is extended by the outage);
2. this coordinator has seen it a suspect for `grace_s` (half a lease): with the lease's
   own lapse that is 6 beats missed, so a node stalled for less than the lease survives;
3. a direct probe (the node's Stats rpc, `probe_timeout_s`) does not show the same
   registration alive: no answer, another epoch (a restarted process), or fenced.

So a dead node is declared dead at most lease + grace_s + one reaper tick (lease/4) +
probe_timeout_s after its last beat: 1.75 leases + 1 s by default. The node fences
itself (gate.py) 0.75 lease after its last renewal was sent, always before that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..protos.errors import InvalidArgument
from .records import NodeInfo

log = logging.getLogger("pagedkv.coordinator.liveness")


class ProbeAnswer(NamedTuple):
    """What a node said to the probe: its registration epoch (0: none) and whether it is
    fenced (cannot prove its lease)."""

    epoch: int
    is_fenced: bool


Probe = Callable[[NodeInfo, float], ProbeAnswer | None]  # (node, timeout) -> answer, None: no answer


@dataclass(frozen=True)
class LivenessConfig:
    lease_ttl_s: float
    grace_s: float | None = None  # None: half the lease
    probe_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.lease_ttl_s > 0:
            raise InvalidArgument(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.grace_s is not None and not self.grace_s >= 0:
            raise InvalidArgument(f"grace_s must be >= 0, got {self.grace_s}")
        if not self.probe_timeout_s > 0:
            raise InvalidArgument(f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")

    @property
    def suspect_grace_s(self) -> float:
        return self.lease_ttl_s / 2 if self.grace_s is None else self.grace_s

    @property
    def detection_bound_s(self) -> float:
        """The longest a dead node goes undeclared after its last beat (reaper at lease/4)."""
        return self.lease_ttl_s * 1.25 + self.suspect_grace_s + self.probe_timeout_s


class Liveness:
    """The reaper's memory: when the store last failed, which nodes it has seen live
    (their address and epoch, for the probe) and since when each suspect is one.
    Thread-safe; a coordinator process has one."""

    def __init__(
        self, config: LivenessConfig, probe: Probe, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._probe = probe
        self._clock = clock
        self._store_ok_since: float | None = None  # None: failing now (or never reached yet)
        self._known: dict[str, NodeInfo] = {}  # node id -> its registration as last seen live
        self._suspect_since: dict[str, float] = {}
        self._lock = threading.Lock()
        self.counters = {"probes": 0, "probes_alive": 0, "outage_extensions": 0}

    def set_lease(self, lease_ttl_s: float) -> None:
        """The lease handed out now (lease_scale.py): the grace and the store's clean spell
        are counted in it from the next verdict on."""
        with self._lock:
            self.config = replace(self.config, lease_ttl_s=lease_ttl_s)

    def store_failed(self) -> None:
        """A store call failed: every lease is extended until it has answered for a lease."""
        with self._lock:
            if self._store_ok_since is not None:
                self.counters["outage_extensions"] += 1
            self._store_ok_since = None
            self._suspect_since.clear()

    def store_answered(self) -> None:
        with self._lock:
            if self._store_ok_since is None:
                self._store_ok_since = self._clock()

    def seen_live(self, nodes: Iterable[NodeInfo]) -> None:
        """The live nodes (refresh_nodes): their registration, and they are no suspects."""
        with self._lock:
            for node in nodes:
                self._known[node.node_id] = node
                self._suspect_since.pop(node.node_id, None)

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._known.pop(node_id, None)
            self._suspect_since.pop(node_id, None)

    def dead(self, expired: Iterable[str]) -> list[str]:
        """Of the nodes whose lease lapsed, the ones to declare dead now (the rules above).
        Probes run outside the lock, one per suspect past its grace."""
        now = self._clock()
        expired = list(expired)
        to_probe: list[tuple[str, NodeInfo | None]] = []
        with self._lock:
            for node_id in list(self._suspect_since):
                if node_id not in expired:
                    del self._suspect_since[node_id]  # it beat again (or was removed)
            ok_since = self._store_ok_since
            if ok_since is None or now - ok_since < self.config.lease_ttl_s:
                return []  # the store was out: the lapse may be the outage's
            for node_id in expired:
                since = self._suspect_since.setdefault(node_id, now)
                if now - since >= self.config.suspect_grace_s:
                    to_probe.append((node_id, self._known.get(node_id)))
        dead = []
        for node_id, info in to_probe:
            if info is not None and self._is_alive(info):
                continue
            dead.append(node_id)
        return dead

    def _is_alive(self, node: NodeInfo) -> bool:
        self.counters["probes"] += 1
        answer = self._probe(node, self.config.probe_timeout_s)
        alive = answer is not None and answer.epoch == node.epoch and not answer.is_fenced
        if alive:
            self.counters["probes_alive"] += 1
            log.info("node %s missed its lease but answers its probe: kept", node.node_id)
        return alive
