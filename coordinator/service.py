"""The coordinator's gRPC servicer: thin -- decode, call Coordinator, encode.

The tenant of every worker call comes from the bearer token (auth.Tenants),
never from a request field. Errors map to status codes through protos.status,
the one translation every role shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import InvalidArgument, NotFound
from ..protos.serving import GrpcServer, build_server, observe
from .auth import Tenants
from .core import Coordinator, OpenResult
from .metrics import CoordinatorMetrics
from .misses import miss_message
from .records import NodeNotLive

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
T = TypeVar("T")
_SPEC_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")


def spec_dict(spec: pb.ModelSpec) -> dict[str, Any] | None:
    """A request's model spec as the store keeps it; None when unset (any node)."""
    if not spec.num_layers:
        return None
    return {name: getattr(spec, name) for name in _SPEC_FIELDS}


def _open_response(result: OpenResult, explain_miss: bool = False) -> pb.CoordOpenResponse:
    resp = pb.CoordOpenResponse(
        extents=[pb.Placement(node_id=result.node_id, address=result.address, first_token=0)],
        num_cached_tokens=result.num_cached_tokens,
        num_host_hit_tokens=result.num_host_hit_tokens,
        num_blocks=result.num_blocks,
    )
    if explain_miss and result.miss is not None:
        resp.miss.CopyFrom(miss_message(result.miss))
    return resp


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, tenants: Tenants, metrics: CoordinatorMetrics) -> None:
        self.coordinator = coordinator
        self.tenants = tenants
        self.metrics = metrics

    def _run(self, method: str, context: grpc.ServicerContext, fn: Callable[[], T]) -> T | None:
        return observe(method, context, fn, self.metrics.observe)

    def _tenant(self, context: grpc.ServicerContext) -> str:
        return self.tenants.tenant_for(context.invocation_metadata())

    # -- nodes --------------------------------------------------------------------

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.RegisterResponse:
            spec = spec_dict(request.spec)
            if spec is None:
                raise InvalidArgument(f"node {request.node_id!r} registered without a model spec")
            self.coordinator.register(
                request.node_id, request.address, spec, request.num_blocks, request.policy
            )
            cfg = self.coordinator.config
            return pb.RegisterResponse(
                lease_ttl_s=cfg.lease_ttl_s, heartbeat_interval_s=cfg.heartbeat_interval_s
            )

        return self._run("Register", context, run)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.HeartbeatResponse:
            load = {f.name: v for f, v in request.load.ListFields()}
            return pb.HeartbeatResponse(is_registered=self.coordinator.heartbeat(request.node_id, load))

        return self._run("Heartbeat", context, run)

    def ReportEvents(self, request: pb.ReportEventsRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.ReportEventsResponse:
            try:
                n = self.coordinator.report_events(request.node_id, [(e.kind, e.key) for e in request.events])
            except NodeNotLive as exc:  # tells the node to register again
                raise NotFound(str(exc)) from None
            return pb.ReportEventsResponse(num_events=n)

        return self._run("ReportEvents", context, run)

    # -- workers ------------------------------------------------------------------

    def Open(self, request: pb.CoordOpenRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            if not request.seq_id:
                raise InvalidArgument("Open needs a seq_id (the client picks one, e.g. a uuid)")
            tenant = self._tenant(context)
            result = self.coordinator.open(
                tenant,
                request.token_ids,
                seq_id=request.seq_id,
                max_cached_tokens=request.max_cached_tokens
                if request.HasField("max_cached_tokens")
                else None,
                spec=spec_dict(request.spec),
                attention=request.attention,
            )
            self.metrics.observe_open(tenant, len(request.token_ids), result.num_cached_tokens)
            return _open_response(result, request.explain_miss)

        with self.coordinator.node_calls.held():
            return self._run("Open", context, run)

    def Lookup(self, request: pb.CoordLookupRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordLookupResponse:
            tokens, node_id = self.coordinator.lookup(
                self._tenant(context), request.token_ids, spec_dict(request.spec)
            )
            return pb.CoordLookupResponse(num_cached_tokens=tokens, node_id=node_id)

        return self._run("Lookup", context, run)

    def Fork(self, request: pb.CoordForkRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            if not request.child_id:
                raise InvalidArgument("Fork needs a child_id")
            return _open_response(
                self.coordinator.fork(self._tenant(context), request.parent_id, request.child_id)
            )

        return self._run("Fork", context, run)

    def Close(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.Empty:
            self.coordinator.close(self._tenant(context), request.seq_id)
            return pb.Empty()

        with self.coordinator.node_calls.held():
            return self._run("Close", context, run)

    def SwapOut(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.SwapResponse:
            return pb.SwapResponse(
                num_blocks=self.coordinator.swap_out(self._tenant(context), request.seq_id)
            )

        return self._run("SwapOut", context, run)

    def SwapIn(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            return _open_response(self.coordinator.swap_in(self._tenant(context), request.seq_id))

        return self._run("SwapIn", context, run)

    def Describe(self, request: pb.CoordSeqRequest, context: grpc.ServicerContext) -> Any:
        def run() -> pb.CoordOpenResponse:
            _, node = self.coordinator.describe(self._tenant(context), request.seq_id)
            return pb.CoordOpenResponse(
                extents=[pb.Placement(node_id=node.node_id, address=node.address, first_token=0)]
            )

        return self._run("Describe", context, run)

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


def create_server(
    coordinator: Coordinator,
    address: str = "127.0.0.1:0",
    *,
    tenants: Tenants | None = None,
    metrics: CoordinatorMetrics | None = None,
    max_workers: int = 32,
) -> tuple[GrpcServer, int]:
    """A coordinator server bound to `address` (not yet started) and its port."""
    metrics = metrics or CoordinatorMetrics(coordinator)
    servicer = CoordinatorServicer(coordinator, tenants or Tenants(), metrics)
    server, health_servicer, port = build_server(
        lambda s: pb_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        address,
        max_workers=max_workers,
        # as the node: a second coordinator on a taken port must fail to bind, not share its traffic
        options=[("grpc.so_reuseport", 0)],
    )
    return GrpcServer(server, health_servicer, [SERVICE_NAME]), port
