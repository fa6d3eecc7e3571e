"""The coordinator's gRPC servicer: thin -- decode, call Coordinator, encode.

The tenant of every worker call comes from the bearer token (auth.Tenants),
never from a request field, and scopes the sequence ids it names (the
coordinator and the nodes know them as "tenant/id"); each placement it answers
carries the worker's ticket for the sequence on its node (auth.ClusterAccess).
The nodes' calls (Register, Heartbeat, ReportEvents, Reserve) need the cluster
credential of the node they name. Errors map to status codes through
protos.status, the one translation every role shares.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import FailedPrecondition, InvalidArgument, NotFound, PagedKVError
from ..protos.framed_server import FramedServer
from ..protos.prompt import tokens_of
from ..protos.serving import GrpcServer, Offload, build_server, observe
from ..protos.spec import ModelSpec
from ..protos.tls import TlsConfig
from ..protos.wire.frame import address_host
from .auth import Tenants
from .core import CloseArgs, Coordinator, OpenArgs, OpenResult
from .membership import Beat
from .metrics import CoordinatorMetrics
from .misses import miss_message
from .quota import reserve
from .records import NodeNotLive, SequenceRecord

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
# The rpcs the framed port serves: a worker's per-request pair and a node's periodic calls.
FRAMED_METHODS = ("Open", "Close", "Heartbeat", "ReportEvents")
# Those it also takes one-way (no reply): a node's event reports, acknowledged by its beats.
ONE_WAY_METHODS = ("ReportEvents",)
# A node's link: its calls are a few microseconds of work each, ~1,300 a second at 1,000 nodes.
NODE_LINK_METHODS = ("Heartbeat", "ReportEvents")
# A plain-TCP connection that carried one of these is served by the port's one-thread loop:
# a node's link, and a worker's Open and Close (no thread handing the interpreter lock to
# another around each store call; what would wait on another thread moves to one: Offload).
LOOP_METHODS = FRAMED_METHODS
MAX_LOST_REPORTED = 1 << 16  # lost ids a registration reply names (the .proto's bound)
MAX_SEQ_ID_CHARS = 512  # a worker's sequence id (a uuid is 36; a vLLM request id ~50)
T = TypeVar("T")
_SPEC_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model")


def spec_dict(spec: pb.ModelSpec) -> dict[str, Any] | None:
    """A request's model spec as the store keeps it, checked (InvalidArgument); None
    when unset (any node)."""
    if not spec.ListFields():
        return None
    fields = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    ModelSpec(**fields)  # every field positive, a known dtype: refused here, not deep in a lookup
    return fields


def unscope(exc: PagedKVError, prefix: str) -> PagedKVError:
    """A copy of exc (same class and ids) with `prefix` ("tenant/") taken off the
    sequence ids in its message and its seq_id; exc itself when it names none."""
    text = str(exc)
    seq_id = getattr(exc, "seq_id", None)
    if f"'{prefix}" not in text and not (isinstance(seq_id, str) and seq_id.startswith(prefix)):
        return exc
    err = PagedKVError.__new__(type(exc))
    Exception.__init__(err, text.replace(f"'{prefix}", "'"))
    err.__dict__.update(exc.__dict__)
    if isinstance(seq_id, str):
        err.seq_id = seq_id.removeprefix(prefix)  # type: ignore[attr-defined]
    return err


def _seq_id(seq_id: str, what: str = "seq_id") -> str:
    if not seq_id:
        raise InvalidArgument(f"a {what} is required (the client picks one, e.g. a uuid)")
    if len(seq_id) > MAX_SEQ_ID_CHARS:  # (a key in Redis, in every ticket and event: bounded)
        raise InvalidArgument(f"a {what} of {len(seq_id)} characters (at most {MAX_SEQ_ID_CHARS})")
    return seq_id


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, tenants: Tenants, metrics: CoordinatorMetrics) -> None:
        self.coordinator = coordinator
        self.tenants = tenants
        self.metrics = metrics
        self.frame_port = 0  # the framed port its replies advertise (create_server sets it)
        self._beat_ok: pb.HeartbeatResponse | None = None  # a renewed beat's reply (not changed)

    def _run(
        self, method: str, context: grpc.ServicerContext, fn: Callable[[], T], start: float | None = None
    ) -> T | None:
        def run() -> T:
            try:
                return fn()
            except PagedKVError as exc:
                raise self._unscoped(exc, context) from None

        return observe(method, context, run, self.metrics.observe, start)

    def _unscoped(self, exc: PagedKVError, context: grpc.ServicerContext) -> PagedKVError:
        """exc as its caller knows its ids: the calling tenant's scope taken off."""
        if not self.tenants.is_enabled:
            return exc
        try:
            prefix = self.tenants.scoped(self._tenant(context), "")
        except PagedKVError:
            return exc
        return unscope(exc, prefix)

    def _tenant(self, context: grpc.ServicerContext) -> str:
        return self.tenants.tenant_for(context.invocation_metadata())

    def _caller(self, context: grpc.ServicerContext, seq_id: str, what: str = "seq_id") -> tuple[str, str]:
        """(the calling tenant, the id the coordinator knows its sequence `seq_id` by)."""
        tenant = self._tenant(context)
        return tenant, self.tenants.scoped(tenant, _seq_id(seq_id, what))

    def _placed(
        self, tenant: str, seq_id: str, result: OpenResult, explain_miss: bool = False
    ) -> pb.CoordOpenResponse:
        """The reply of a call that placed (or found) a sequence: where it is, by which
        id its node knows it, the worker's ticket for it there and, when asked, why its
        prompt missed."""
        node = self.coordinator.node(result.node_id)
        ticket = self.coordinator.config.access.ticket(tenant, seq_id, node)
        resp = pb.CoordOpenResponse(
            extents=[
                pb.Placement(node_id=result.node_id, address=result.address, first_token=0, ticket=ticket)
            ],
            num_cached_tokens=result.num_cached_tokens,
            num_host_hit_tokens=result.num_host_hit_tokens,
            num_blocks=result.num_blocks,
            num_pending_tokens=result.num_pending_tokens,
            node_seq_id=seq_id,
            frame_port=self.frame_port,
            takes_packed_prompts=True,
            prompt_ref=result.prompt_ref,
            prompt_ref_tokens=result.prompt_ref_tokens,
            block_size=result.block_size,
        )
        if explain_miss and result.miss is not None:
            resp.miss.CopyFrom(miss_message(result.miss))
        if result.node_open is not None:
            resp.node_open.CopyFrom(result.node_open)
        return resp

    def _extents(self, tenant: str, seq_id: str, record: SequenceRecord) -> pb.CoordOpenResponse:
        """The reply naming every extent of a sequence: node, first token, the worker's ticket there."""
        access = self.coordinator.config.access
        placed = self.coordinator.extent_nodes(record)
        bs = int(placed[0][1].spec["block_size"])
        return pb.CoordOpenResponse(
            extents=[
                pb.Placement(
                    node_id=node.node_id,
                    address=node.address,
                    first_token=ext.first_logical_block * bs,
                    ticket=access.ticket(tenant, seq_id, node),
                )
                for ext, node in placed
            ],
            node_seq_id=seq_id,
            frame_port=self.frame_port,
        )

    def _node(self, context: grpc.ServicerContext, node_id: str, method: str) -> None:
        self.coordinator.config.access.check_node(context.invocation_metadata(), node_id, method)

    # -- nodes --------------------------------------------------------------------

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.RegisterResponse:
            self._node(context, request.node_id, "Register")
            spec = spec_dict(request.spec)
            if spec is None:
                raise InvalidArgument(f"node {request.node_id!r} registered without a model spec")
            live = self.coordinator.live_node(request.node_id)
            if live is not None and live.epoch != request.epoch and not self.coordinator.is_replaced(live):
                raise FailedPrecondition(
                    f"node id {request.node_id!r} is live (at {live.address}); a new registration cannot "
                    f"take it over: wait for its lease to lapse (up to {self.coordinator.lease_s:g} s) "
                    "or give this node another id"
                )
            epoch = secrets.randbits(63) | 1
            # An older node keeps the lease it is handed here: the configured one
            lease = self.coordinator.lease_s if request.adapts_lease else self.coordinator.config.lease_ttl_s
            result = self.coordinator.register(
                request.node_id, request.address, spec, request.num_blocks, epoch, request.policy, lease
            )
            return pb.RegisterResponse(
                lease_ttl_s=lease,
                heartbeat_interval_s=lease / 4,
                epoch=epoch,
                lost_seq_ids=result.lost_seq_ids[:MAX_LOST_REPORTED],
                frame_port=self.frame_port,
                takes_one_way_reports=bool(self.frame_port),
            )

        return self._run("Register", context, run)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.HeartbeatResponse:
            self._node(context, request.node_id, "Heartbeat")
            beat = self.coordinator.heartbeat(*_beat_of(request), held_lease_s=_held_lease(request))
            return self._beat_reply(request, beat)

        return self._run("Heartbeat", context, run)

    def batches(self) -> dict[str, Callable[[Any], list[Callable[[], Any]]]]:
        """The framed port's batched methods: a loop's turn answers their calls together."""
        return {"Heartbeat": self.Heartbeats, "Open": self.Opens, "Close": self.Closes}

    def Heartbeats(self, calls: Sequence[tuple[pb.HeartbeatRequest, Any]]) -> list[Callable[[], Any]]:
        """Heartbeat of several calls (those a framed loop's turn took): each call's credential
        checked, their renewals in one store round trip; returns a function per call that
        answers it as Heartbeat would (its reply, or its error raised as Heartbeat raises it)."""
        results: dict[int, Beat | PagedKVError] = {}
        checked = []
        for i, (request, context) in enumerate(calls):
            try:
                self._node(context, request.node_id, "Heartbeat")
                checked.append(i)
            except PagedKVError as exc:
                results[i] = exc
        if checked:
            try:
                held = [_held_lease(calls[i][0]) for i in checked]
                renewed = self.coordinator.heartbeats([_beat_of(calls[i][0]) for i in checked], held)
                results.update(zip(checked, renewed, strict=True))
            except PagedKVError as exc:  # (the store failed them all)
                results.update(dict.fromkeys(checked, exc))

        def answer(request: pb.HeartbeatRequest, context: Any, result: Any) -> Callable[[], Any]:
            def run() -> pb.HeartbeatResponse:
                if isinstance(result, PagedKVError):
                    raise result
                return self._beat_reply(request, result)

            return lambda: self._run("Heartbeat", context, run)

        return [answer(request, context, results[i]) for i, (request, context) in enumerate(calls)]

    def _beat_reply(self, request: pb.HeartbeatRequest, result: Beat) -> pb.HeartbeatResponse:
        ok, free, lease = result
        if ok and not free and not request.events_epoch:  # (most beats: one reply, kept)
            kept = self._beat_ok
            if kept is None or kept.frame_port != self.frame_port or kept.lease_ttl_s != lease:
                kept = self._beat_ok = pb.HeartbeatResponse(
                    is_registered=True,
                    frame_port=self.frame_port,
                    takes_one_way_reports=bool(self.frame_port),
                    lease_ttl_s=lease,
                    heartbeat_interval_s=lease / 4,
                )
            return kept
        reply = pb.HeartbeatResponse(
            is_registered=ok,
            free_seq_ids=free,
            frame_port=self.frame_port,
            takes_one_way_reports=bool(self.frame_port),
        )
        if ok:
            reply.lease_ttl_s, reply.heartbeat_interval_s = lease, lease / 4
        if ok and request.events_epoch:  # (after the renewal: a revived node's events are taken)
            acked = self.coordinator.events_acknowledged(request.node_id, request.events_epoch)
            if acked is not None:
                reply.applied_seq, reply.next_seq = acked
        return reply

    def ReportEvents(self, request: pb.ReportEventsRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.ReportEventsResponse:
            num_events, applied, next_seq = self._report(request, context)
            return pb.ReportEventsResponse(num_events=num_events, applied_seq=applied, next_seq=next_seq)

        return self._run("ReportEvents", context, run)

    def ReportEventsOneWay(self, request: pb.ReportEventsRequest, context: grpc.ServicerContext) -> None:
        """ReportEvents sent one-way (a node's link: a framed NOTIFY): the same checks, queueing
        and metrics, no reply built (the node's next beat says how far its events got). A
        node's report names no sequence, so its errors need no unscoping (_run)."""
        observe("ReportEvents", context, lambda: self._report(request, context), self.metrics.observe)

    def one_way_handlers(self) -> dict[str, Callable[[Any, Any], None]]:
        """The framed port's handlers of ONE_WAY_METHODS sent as NOTIFY (no reply to build)."""
        return {name: getattr(self, name + "OneWay") for name in ONE_WAY_METHODS}

    def _report(self, request: pb.ReportEventsRequest, context: grpc.ServicerContext) -> tuple[int, int, int]:
        """A report's (events taken, applied, next_seq); 0, 0 for an older node's unnumbered one."""
        self._node(context, request.node_id, "ReportEvents")
        events = [(e.kind, e.key) for e in request.events]
        try:
            if not request.first_seq:  # an older node's: applied before the reply
                return self.coordinator.report_events(request.node_id, events), 0, 0
            applied, next_seq = self.coordinator.report_numbered(
                request.node_id, request.epoch, request.first_seq, events, request.base_seq
            )
        except NodeNotLive as exc:  # tells the node to register again
            raise NotFound(str(exc)) from None
        return len(events), applied, next_seq

    # -- workers ------------------------------------------------------------------

    def Open(self, request: pb.CoordOpenRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            o = self._open_args(request, context)
            result = self.coordinator.open(
                o.tenant,
                o.token_ids,
                seq_id=o.seq_id,
                max_cached_tokens=o.max_cached_tokens,
                spec=o.spec,
                attention=o.attention,
                request_id=o.request_id,
                worker_opens=o.worker_opens,
                carried_prompt=o.carried_prompt,
                prefix_ref=o.prefix_ref,
                prefix_tokens=o.prefix_tokens,
            )
            return self._opened(o, result, request)

        with self.coordinator.node_calls.held():
            return self._run("Open", context, run)

    def _open_args(self, request: pb.CoordOpenRequest, context: grpc.ServicerContext) -> OpenArgs:
        tenant, seq_id = self._caller(context, request.seq_id)
        return OpenArgs(
            tenant,
            tokens_of(request, "Open"),
            seq_id,
            request.max_cached_tokens if request.HasField("max_cached_tokens") else None,
            spec_dict(request.spec),
            request.attention,
            request.request_id,
            request.worker_opens,
            request.worker_opens and request.carries_prompt,
            request.prefix_ref,
            request.prefix_tokens,
        )

    def _opened(self, o: OpenArgs, result: OpenResult, request: pb.CoordOpenRequest) -> pb.CoordOpenResponse:
        self.metrics.observe_open(o.tenant, o.prefix_tokens + len(o.token_ids), result.num_cached_tokens)
        return self._placed(o.tenant, o.seq_id, result, request.explain_miss)

    def Opens(self, calls: Sequence[tuple[pb.CoordOpenRequest, Any]]) -> list[Callable[[], Any]]:
        """Open of several calls (those a framed loop's turn took): each checked, their page
        tables written in one store round trip (Coordinator.open_many); returns a function per
        call that answers it as Open would. One whose id has a node call in flight, or that
        an earlier call of the batch opens, waits for it: handed back (Offload), Open answers
        it from another thread."""
        start = time.perf_counter()
        results: dict[int, OpenResult | PagedKVError | None] = {}  # None: handed back
        batch: list[tuple[int, OpenArgs]] = []
        ids: set[str] = set()
        for i, (request, context) in enumerate(calls):
            try:
                o = self._open_args(request, context)
            except PagedKVError as exc:
                results[i] = exc
                continue
            if o.seq_id in ids or self.coordinator.is_in_flight(o.seq_id):
                results[i] = None
            else:
                ids.add(o.seq_id)
                batch.append((i, o))
        if batch:
            with self.coordinator.node_calls.held():
                results.update(
                    zip((i for i, _ in batch), self.coordinator.open_many([o for _, o in batch]), strict=True)
                )
        opened = dict(batch)

        def answer(i: int, request: pb.CoordOpenRequest, context: Any) -> Callable[[], Any]:
            def run() -> pb.CoordOpenResponse:
                result = results[i]
                if result is None:
                    raise Offload
                if isinstance(result, PagedKVError):
                    raise result
                return self._opened(opened[i], result, request)

            return lambda: self._run("Open", context, run, start)

        return [answer(i, request, context) for i, (request, context) in enumerate(calls)]

    def Lookup(self, request: pb.CoordLookupRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordLookupResponse:
            tokens, node_id = self.coordinator.lookup(
                self._tenant(context), request.token_ids, spec_dict(request.spec)
            )
            return pb.CoordLookupResponse(num_cached_tokens=tokens, node_id=node_id)

        return self._run("Lookup", context, run)

    def Fork(self, request: pb.CoordForkRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            tenant, child_id = self._caller(context, request.child_id, "child_id")
            parent_id = self.tenants.scoped(tenant, _seq_id(request.parent_id, "parent_id"))
            result = self.coordinator.fork(tenant, parent_id, child_id)
            assert result.record is not None  # fork always answers its page table
            return self._extents(tenant, child_id, result.record)

        return self._run("Fork", context, run)

    def Close(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.Empty:
            c = self._close_args(request, context)
            self.coordinator.close(c.tenant, c.seq_id, c.keep_prefix, freed_extents=c.freed_extents)
            return pb.Empty()

        with self.coordinator.node_calls.held():
            return self._run("Close", context, run)

    def Closes(self, calls: Sequence[tuple[pb.CoordSeqRequest, Any]]) -> list[Callable[[], Any]]:
        """Close of several calls (those a framed loop's turn took): their page tables dropped
        in one store round trip (Coordinator.close_many); a function per call that answers it
        as Close would."""
        start = time.perf_counter()
        results: dict[int, PagedKVError | None] = {}
        batch: list[tuple[int, CloseArgs]] = []
        for i, (request, context) in enumerate(calls):
            try:
                batch.append((i, self._close_args(request, context)))
            except PagedKVError as exc:
                results[i] = exc
        if batch:
            with self.coordinator.node_calls.held():
                results.update(
                    zip(
                        (i for i, _ in batch), self.coordinator.close_many([c for _, c in batch]), strict=True
                    )
                )

        def answer(i: int, context: Any) -> Callable[[], Any]:
            def run() -> pb.Empty:
                error = results[i]
                if error is not None:
                    raise error
                return pb.Empty()

            return lambda: self._run("Close", context, run, start)

        return [answer(i, context) for i, (_, context) in enumerate(calls)]

    def _close_args(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> CloseArgs:
        keep = request.keep_prefix if request.HasField("keep_prefix") else None
        tenant, seq_id = self._caller(context, request.seq_id)
        return CloseArgs(tenant, seq_id, keep, request.freed_extents)

    def SwapOut(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.SwapResponse:
            return pb.SwapResponse(
                num_blocks=self.coordinator.swap_out(*self._caller(context, request.seq_id))
            )

        return self._run("SwapOut", context, run)

    def SwapIn(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            tenant, seq_id = self._caller(context, request.seq_id)
            result = self.coordinator.swap_in(tenant, seq_id)
            assert result.record is not None  # swap_in always answers its page table
            resp = self._extents(tenant, seq_id, result.record)
            resp.num_blocks = result.num_blocks
            return resp

        return self._run("SwapIn", context, run)

    def Describe(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            tenant, seq_id = self._caller(context, request.seq_id)
            if request.node_not_found:  # a data call's NOT_FOUND: asks the node (missing.py)
                record, _ = self.coordinator.describe_not_found(tenant, seq_id)
            else:
                record, _ = self.coordinator.describe(tenant, seq_id)
            return self._extents(tenant, seq_id, record)

        return self._run("Describe", context, run)

    def Extend(self, request: pb.CoordExtendRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            tenant, seq_id = self._caller(context, request.seq_id)
            record = self.coordinator.extend(tenant, seq_id, request.num_tokens, request.attention)
            return self._extents(tenant, seq_id, record)

        return self._run("Extend", context, run)

    def Pin(self, request: pb.CoordPinRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.PinResponse:
            tenant = self._tenant(context)
            return pb.PinResponse(
                num_tokens=self.coordinator.pin(tenant, request.token_ids, spec_dict(request.spec))
            )

        return self._run("Pin", context, run)

    def Unpin(self, request: pb.CoordPinRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.PinResponse:
            tenant = self._tenant(context)
            tokens = self.coordinator.unpin(tenant, request.token_ids, spec_dict(request.spec))
            return pb.PinResponse(num_tokens=tokens)

        return self._run("Unpin", context, run)

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordStatsResponse:
            counters, nodes = self.coordinator.stats()
            return pb.CoordStatsResponse(
                counters=counters,
                nodes=[
                    pb.RegisterRequest(
                        node_id=n.node_id,
                        address=n.address,
                        spec=pb.ModelSpec(**n.spec),
                        num_blocks=n.num_blocks,
                    )
                    for n in nodes
                ],
            )

        return self._run("Stats", context, run)

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.ReserveResponse:
            self._node(context, request.node_id, "Reserve")
            new = reserve(
                self.coordinator, request.node_id, request.seq_id, request.min_blocks, request.num_blocks
            )
            return pb.ReserveResponse(max_blocks=new)

        return self._run("Reserve", context, run)


def create_server(
    coordinator: Coordinator,
    address: str = "127.0.0.1:0",
    *,
    tenants: Tenants | None = None,
    metrics: CoordinatorMetrics | None = None,
    max_workers: int = 32,
    tls: TlsConfig | None = None,
    frame_port: int | None = 0,
) -> tuple[GrpcServer, int]:
    """A coordinator server bound to `address` (not yet started) and its port; TLS
    on it with `tls`. The cluster secret and TLS to the nodes are the coordinator's
    config (CoordinatorConfig.access). `frame_port`: the framed port for FRAMED_METHODS
    on the same host (0: any free port, None: none), TLS as the gRPC port; its number
    is the companion's `port` (`server.companions`)."""
    metrics = metrics or CoordinatorMetrics(coordinator)
    servicer = CoordinatorServicer(coordinator, tenants or Tenants(), metrics)
    server, health_servicer, port = build_server(
        lambda s: pb_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        address,
        max_workers=max_workers,
        # as the node: a second coordinator on a taken port must fail to bind, not share its traffic
        options=[("grpc.so_reuseport", 0)],
        tls=tls,
    )
    framed = []
    if frame_port is not None:
        host = address_host(address) or "0.0.0.0"
        service = pb.DESCRIPTOR.services_by_name["Coordinator"]
        framed.append(
            FramedServer(
                servicer,
                service,
                pb,
                FRAMED_METHODS,
                host,
                frame_port,
                tls=tls,
                one_way=servicer.one_way_handlers(),
                loop_methods=LOOP_METHODS,
                batches=servicer.batches(),
            )
        )
        servicer.frame_port = framed[0].port
    return GrpcServer(server, health_servicer, [SERVICE_NAME], framed), port


def _held_lease(request: pb.HeartbeatRequest) -> float:
    """The lease a beat's node believes it holds; 0 for none (an older node) or nonsense."""
    held = request.lease_ttl_s
    return held if 0 < held < math.inf else 0.0


def _beat_of(request: pb.HeartbeatRequest) -> tuple[str, dict[str, int], list[str] | None]:
    """(node_id, load, held) of a beat: held only when the beat lists every sequence."""
    load = {f.name: v for f, v in request.load.ListFields()}
    return request.node_id, load, list(request.held_seq_ids) if request.held_complete else None
