"""CoordinatorLink: how a node takes part in a cluster, over the protos stubs
only (a node works with any control plane that speaks the contract).

A background thread registers the node, then loops:
- drains the engine's stored/removed block events and reports them with the
  node's load, numbered in recorded order per registration. The coordinator queues
  them and applies them in batches; each event is kept here until a reply says the
  store holds it (applied_seq), and what a reply asks for (next_seq: after a failed
  send, a restarted coordinator) is sent again, so the prefix index stays exact.
  Events sent and not yet known applied are asked about after `sync_after_s`
  (an empty report). It polls the engine's
  pending-event count every `event_poll_s` (a lock-free length read) and sends as
  soon as there is something, but at most once per `event_interval_s`: a burst
  after a quiet spell reaches the index within a few ms (the next open of the
  same prompt hits it), a busy node's events are coalesced;
- every `heartbeat_interval_s` (a quarter of the lease the coordinator hands out),
  renews the lease: a beat is due an interval after the last one was sent, goes before
  any report, and a report waits on its answer at most a beat, so a slow coordinator
  delays the renewals by no more than its answers take. Each reply hands out the lease
  and interval from then on: the coordinator lengthens the lease as the fleet grows
  (coordinator/lease_scale.py), and each beat says the lease it holds, so a renewal
  never runs shorter than it.
A lapsed lease only makes the node a suspect (NOT_FOUND on a report): the next
heartbeat revives it. When the heartbeat says is_registered=false, the node was
declared dead -- its sequences marked lost, its keys purged -- so it fences itself,
remembers its sequences as lost (their data calls answer SequenceLost), resets its
engine and registers again, empty. While the coordinator is unreachable it retries
with capped backoff (at most a beat) and keeps serving only while its lease is
provably live (gate.py: fencing): the lease runs from when the last acknowledged
renewal was sent, minus a margin of one beat.

Reconciliation (coordinator/reconcile.py): every RECONCILE_EVERY beats the heartbeat
carries the ids of every sequence the node holds; the reply names the ones the store
does not know (past a grace), which the node frees.

With the cluster secret, every call carries a NODE ticket the node signs for its
own id (the coordinator refuses nodes without one), and each registration's epoch
goes to the node's gate: tickets for an earlier registration are refused. A node
re-registering names its current epoch, so only it may replace its own live
registration. `reserve` is the gate's way to ask for more of a tenant's quota.

Beats and event reports take the coordinator's framed port once its replies name one
(protos/framed_client.py: a small rpc's cost without gRPC's), gRPC when it cannot be
reached; registration and Reserve stay on gRPC. When the coordinator says its port takes
reports one-way (takes_one_way_reports), they go without a reply (half a framed call's
cost to the coordinator) and each beat asks how far the events got (events_epoch): its
reply settles the outbox, and a restarted coordinator's asks for what it lost, within a
beat. No empty reports ask meanwhile (at 1,000 nodes: thousands of calls a second).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from typing import Any

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import PagedKVError
from ..protos.framed_client import FramedPort, NotCarried
from ..protos.status import error_from_rpc
from ..protos.tickets import RIGHT_NODE, TICKET_KEY, ClusterKeys, Minter
from ..protos.tls import TlsConfig, secure_channel
from ..protos.wire.unary import encode_metadata
from .engine import CacheEngine
from .event_outbox import EventOutbox
from .gate import Gate
from .kv_manager import OFFLOADED, STORED

log = logging.getLogger("pagedkv.node.link")
RECONCILE_EVERY = 4  # beats: one full report of held sequence ids per lease
MAX_HELD_REPORT = 1 << 16  # more ids than this are not reported (the coordinator then skips us)
# A one-way report or a beat may wait this long at the coordinator, which then serves many
# nodes' together (protos/framed_loop.py: one wake-up of its thread for several); an idle
# node's beat (no events pending: its link thread has nothing else to send) this long, which
# the coordinator spends holding it to renew more beats in one store round trip.
LINK_WAIT_S = 0.01
BEAT_WAIT_S = 0.05
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _event_kind(kind: str) -> int:
    if kind == STORED:
        return pb.BlockEvent.STORED
    return pb.BlockEvent.OFFLOADED if kind == OFFLOADED else pb.BlockEvent.REMOVED


def node_load(engine: CacheEngine) -> pb.NodeLoad:
    s = engine.stats()
    return pb.NodeLoad(
        free_blocks=s["free_blocks"],
        cached_blocks=s["cached_blocks"],
        used_blocks=s["used_blocks"],
        num_blocks=s["num_blocks"],
        host_free_blocks=s["host_free_blocks"],
        num_sequences=s["num_sequences"],
    )


_REPLIES = {"Heartbeat": pb.HeartbeatResponse, "ReportEvents": pb.ReportEventsResponse}


class FramedRpcError(grpc.RpcError):
    """A framed call's error reply, as the grpc.RpcError the link handles."""

    def __init__(self, error: PagedKVError) -> None:
        super().__init__(str(error))
        self.error = error

    def code(self) -> grpc.StatusCode:
        name = getattr(self.error, "grpc_status", None) or self.error.status_name
        return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)

    def details(self) -> str:
        return str(self.error)


class CoordinatorLink:
    def __init__(
        self,
        engine: CacheEngine,
        coordinator_address: str,
        node_id: str,
        advertise_address: str,
        *,
        metrics_address: str = "",
        event_interval_s: float = 0.01,
        event_poll_s: float = 0.002,
        sync_after_s: float = 0.05,
        rpc_timeout_s: float = 2.0,
        keys: ClusterKeys | None = None,
        tls: TlsConfig | None = None,
        gate: Gate | None = None,
        one_way_reports: bool = True,
    ) -> None:
        self.engine = engine
        self.node_id = node_id
        self.advertise_address = advertise_address
        self.metrics_address = metrics_address
        self.event_interval_s = event_interval_s
        self.event_poll_s = event_poll_s
        self.rpc_timeout_s = rpc_timeout_s
        # Reconnect within a second after a coordinator restart (gRPC's default backoff
        # grows to 120 s, which could outlast our lease and get us declared dead).
        self._channel = secure_channel(coordinator_address, tls, RECONNECT_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        # Beats and event reports on the coordinator's framed port once a reply names it
        self._framed = FramedPort(coordinator_address, None, tls)
        self.one_way_reports = one_way_reports  # send reports one-way where the coordinator takes them
        self._takes_one_way = False  # the coordinator's last reply said its framed port does
        self._minter = None if keys is None else Minter(keys, ttl_s=600.0)
        self.gate = gate
        if gate is not None:
            gate.reserve = self.reserve
            gate.keep_lease()  # a node of a cluster serves only while its lease is live
        self.epoch = 0  # this node's registration epoch (0: not registered)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"coordinator-link-{node_id}", daemon=True)
        self.outbox = EventOutbox(sync_after_s)  # events until the store holds them
        self.heartbeat_interval_s = 1.0
        self.lease_ttl_s = 0.0
        self.is_registered = threading.Event()
        self.num_registrations = 0
        self.num_beats = 0
        self.num_orphans_freed = 0  # sequences freed because the store did not know them

    def start(self) -> CoordinatorLink:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._channel.close()
        self._framed.close()

    def _metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The NODE ticket this node signs for itself (none without a cluster secret)."""
        if self._minter is None:
            return ()
        return ((TICKET_KEY, self._minter.get(RIGHT_NODE, self.node_id)),)

    def _call(self, method: str, request: Any, timeout_s: float, may_wait_s: float = 0.0) -> Any:
        """`method` on the coordinator's framed port when it advertised one, else over gRPC
        (and when the port cannot carry it); a failure is a grpc.RpcError either way."""
        if self._framed.is_usable:
            metadata = encode_metadata(self._metadata())
            try:
                return self._framed.call(method, request, _REPLIES[method], timeout_s, metadata, may_wait_s)
            except NotCarried:
                pass
            except PagedKVError as exc:
                raise FramedRpcError(exc) from None
        return getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata())

    def _register(self) -> float:
        """Register (again); when it was sent (time.monotonic: the lease runs from then)."""
        spec = self.engine.spec
        sent_at = time.monotonic()
        reply = self._stub.Register(
            pb.RegisterRequest(
                node_id=self.node_id,
                address=self.advertise_address,
                spec=pb.ModelSpec(**spec.to_dict()),
                num_blocks=self.engine.config.num_blocks,
                num_host_blocks=self.engine.config.num_host_blocks,
                metrics_address=self.metrics_address,
                policy=self.engine.config.policy,
                epoch=self.epoch,
                adapts_lease=True,
            ),
            timeout=self.rpc_timeout_s,
            metadata=self._metadata(),
        )
        self._framed.learn(reply.frame_port)
        self._takes_one_way = reply.takes_one_way_reports
        if reply.epoch != self.epoch:  # a new registration numbers its events from 1
            self.outbox.restart()
        self.epoch = reply.epoch
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self.lease_ttl_s = reply.lease_ttl_s
        if self.gate is not None:
            self.gate.set_registration(self.node_id, reply.epoch)
            if reply.lost_seq_ids:
                self.gate.mark_lost(reply.lost_seq_ids, f"node {self.node_id} restarted (its KV is gone)")
            self._renewed(sent_at)
        self.num_registrations += 1
        self.is_registered.set()
        log.info("node %s registered (lease %.1fs)", self.node_id, reply.lease_ttl_s)
        return sent_at

    def _rejoin(self) -> float:
        """The coordinator declared this node dead: come back empty (when the new
        registration was sent)."""
        self.is_registered.clear()
        held = self._held_ids()
        log.warning(
            "node %s lost its lease: %d sequences lost; resetting and registering again",
            self.node_id,
            len(held),
        )
        if self.gate is not None:
            reason = f"node {self.node_id} was declared dead (its lease lapsed) and came back empty"
            self.gate.fence(reason)
            self.gate.mark_lost(held, reason)
        self.engine.reset()
        if self.gate is not None:
            self.gate.reset()
        self.engine.take_events()
        self.epoch = 0  # that registration is gone: a fresh one
        return self._register()

    def _report(self) -> None:
        box = self.outbox
        box.add([pb.BlockEvent(kind=_event_kind(e.kind), key=e.key) for e in self.engine.take_events()])
        one_way = self.one_way_reports and self._takes_one_way and self._framed.is_usable
        box.is_acked_by_beats = one_way
        if not box.is_due():
            return
        first_seq, base_seq, events = box.to_send()  # (none: asks how far the store got)
        request = pb.ReportEventsRequest(
            node_id=self.node_id,
            events=events,
            load=node_load(self.engine),
            epoch=self.epoch,
            first_seq=first_seq,
            base_seq=base_seq,
        )
        # At most a beat: a report held that long would hold the lease's next renewal too
        timeout = min(self.rpc_timeout_s, max(self.heartbeat_interval_s, 0.2))
        if one_way and events:
            try:
                metadata = encode_metadata(self._metadata())
                self._framed.notify("ReportEvents", request, timeout, metadata, LINK_WAIT_S)
                box.mark_sent()  # (the next beat's reply says how far it got)
                return
            except NotCarried:
                pass  # not sent whole: as a call, over gRPC when the port cannot take it
        try:
            reply = self._call("ReportEvents", request, timeout)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # Our lease lapsed. A heartbeat revives a suspect node (events kept,
            # sent next tick) or tells us we were removed (then we rejoin empty).
            self._heartbeat()
            return
        box.settle(reply.applied_seq, reply.next_seq)

    def _renewed(self, sent_at: float) -> None:
        """A renewal sent at `sent_at` was acknowledged: the gate's lease runs from then."""
        if self.gate is not None and self.lease_ttl_s > 0:
            self.gate.lease_renewed(sent_at, self.lease_ttl_s, self.heartbeat_interval_s)

    def _held_ids(self) -> list[str]:
        """The ids of every sequence the engine holds (a snapshot)."""
        for _ in range(4):
            try:
                return list(self.engine.manager.seqs)
            except RuntimeError:  # changed size while copied: try again
                continue
        return []

    def _heartbeat(self) -> float:
        """Renew the lease (or rejoin when declared dead); when the beat (or the
        registration) was sent."""
        request = pb.HeartbeatRequest(
            node_id=self.node_id, load=node_load(self.engine), lease_ttl_s=self.lease_ttl_s
        )
        if self.outbox.pending and self.outbox.is_acked_by_beats:  # how far did our events get?
            request.events_epoch = self.epoch
        self.num_beats += 1
        if self.num_beats % RECONCILE_EVERY == 0:
            held = self._held_ids()
            if len(held) <= MAX_HELD_REPORT:
                request.held_seq_ids.extend(held)
                request.held_complete = True
        sent_at = time.monotonic()
        # The renewal counts from when it was sent, so a late answer (a loaded coordinator) still
        # renews; one slower than half the lease would leave too little of it: fail and retry.
        timeout = min(self.rpc_timeout_s, max(self.lease_ttl_s / 2, 0.2))
        # An idle node's beat may wait longer (nothing else waits on it here)
        idle = not self.outbox.pending and not self.engine.num_pending_events()
        reply = self._call("Heartbeat", request, timeout, BEAT_WAIT_S if idle else LINK_WAIT_S)
        if reply.frame_port != self._framed.port:
            self._framed.learn(reply.frame_port)
        self._takes_one_way = reply.takes_one_way_reports
        if not reply.is_registered:
            return self._rejoin()
        lease, interval = reply.lease_ttl_s, reply.heartbeat_interval_s  # (0: an older coordinator)
        if 0 < interval < lease < math.inf:  # (else nonsense: the fence must stay finite and ahead)
            # The lease this renewal grants (the store holds it at least as long as the one
            # believed until now), and the interval that keeps the fleet's beats in budget.
            self.lease_ttl_s, self.heartbeat_interval_s = lease, interval
        self._renewed(sent_at)
        if request.events_epoch and reply.next_seq:  # (0: an older coordinator, or not live)
            self.outbox.settle(reply.applied_seq, reply.next_seq)
        for seq_id in reply.free_seq_ids:  # held here, unknown to the store past a grace
            try:
                self.engine.free(seq_id)
            except PagedKVError:
                continue  # already gone
            if self.gate is not None:
                self.gate.drop(seq_id)
            self.num_orphans_freed += 1
            log.warning("node %s freed sequence %s: the store does not know it", self.node_id, seq_id)
        return sent_at

    def _wait_for_events(self, until: float) -> None:
        """Sleep until the engine has events to report (polled), `until`, or stop."""
        while not self._stop.is_set() and not self.engine.num_pending_events() and not self.outbox.is_due():
            left = until - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(self.event_poll_s, left))

    def _run(self) -> None:
        backoff = 0.1
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                if not self.is_registered.is_set():
                    next_beat = self._register() + self.heartbeat_interval_s
                # The lease first, on a schedule from each beat's send (not its answer): a slow
                # answer does not push the next beat back (a report before it waits a beat at most).
                if time.monotonic() >= next_beat:
                    next_beat = self._heartbeat() + self.heartbeat_interval_s
                self._report()
                backoff = 0.1
                self._stop.wait(self.event_interval_s)  # the coalescing gap between two reports
                self._wait_for_events(next_beat)
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                if self.gate is not None:
                    self.gate.lease_failing(f"its coordinator answered {code.name}: {err.details()}")  # type: ignore[attr-defined]
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("coordinator unreachable from node %s: %s", self.node_id, code)
                else:  # refused (a live registration of this id, a wrong cluster secret, ...)
                    log.warning("coordinator refused node %s: %s: %s", self.node_id, code, err.details())  # type: ignore[attr-defined]
                backoff = self._back_off(backoff)
            except Exception:  # never let the link thread die silently
                log.exception("coordinator link of node %s failed; retrying", self.node_id)
                backoff = self._back_off(backoff)

    def reserve(self, seq_id: str, min_blocks: int, num_blocks: int) -> int:
        """More of a sequence's tenant quota (Coordinator.Reserve): its new allowance
        in blocks. Raises the coordinator's error (QuotaExceeded, Unavailable, ...)."""
        try:
            reply = self._stub.Reserve(
                pb.ReserveRequest(
                    node_id=self.node_id, seq_id=seq_id, min_blocks=min_blocks, num_blocks=num_blocks
                ),
                timeout=self.rpc_timeout_s,
                metadata=self._metadata(),
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, "coordinator") from None
        return int(reply.max_blocks)

    def _back_off(self, backoff: float) -> float:
        """Wait `backoff` with jitter (half fixed, half random, so nodes that lost one coordinator
        do not retry in lockstep); the next is doubled, capped at a beat (2 s at most), so the
        lease is renewed within a beat of the coordinator (or its store) coming back."""
        self._stop.wait(backoff / 2 + random.uniform(0, backoff / 2))
        return min(backoff * 2, 2.0, max(self.heartbeat_interval_s, 0.1))
