"""The cache node's gRPC server: CacheEngine on the wire.

`create_server(engine, address)` builds a server bound to `address` (port 0
picks a free port, for tests) and returns it with the bound port. The servicer
is thin -- decode the request, call the engine, encode the result -- and every
handler runs inside `_observe`, which times it, maps a raised error to its
status code (status.py, the one translation) and counts failures. A bad
request never takes the server down; an unexpected exception becomes INTERNAL.

Every handler asks the node's Gate (gate.py) first, before the engine sees the
request: the control rpcs need the coordinator's credential on a node serving a
cluster, the data rpcs a ticket per sequence (tickets come in the call's
metadata) and a live lease (fencing). Stats tells the coordinator's liveness probe
the node's registration epoch and whether it is fenced. Health checking
(grpc.health.v1) and server reflection are on, so grpcurl and grpc_health_probe work
against a node. `NodeServer.stop(grace)` flips health to
NOT_SERVING first, so load balancers stop routing, then drains.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos import tensors
from ..protos.attention import from_messages
from ..protos.errors import (
    CapacityExceeded,
    IntegrityError,
    InvalidArgument,
    PagedKVError,
)
from ..protos.prompt import tokens_of
from ..protos.serving import GrpcServer, build_server
from ..protos.status import abort_details
from ..protos.tickets import RIGHT_READ, RIGHT_WRITE, unseal_salt
from ..protos.tls import TlsConfig
from .engine import CacheEngine
from .gate import Credentials, Gate, NodeTrust
from .metrics import NodeMetrics
from .orders import OpenOrders, order_digest
from .serve import BulkLimits, BulkServer, bulk_host

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheNode"].full_name
SERVER_OPTIONS = [*tensors.MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)]
T = TypeVar("T")


class CacheNodeServicer(pb_grpc.CacheNodeServicer):
    def __init__(self, engine: CacheEngine, metrics: NodeMetrics, gate: Gate | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.gate = gate or Gate()
        self._spec = engine.spec
        self.bulk_port = 0  # advertised in Stats; set by create_server when the bulk channel is on
        self._orders = OpenOrders()

    def _creds(self, context: grpc.ServicerContext) -> Credentials:
        return self.gate.from_metadata(context.invocation_metadata())

    def _admin(self, context: grpc.ServicerContext, method: str) -> None:
        self.gate.require_admin(self._creds(context), method)

    def _held(self, seq_id: str) -> int:
        return self.engine.cache_length(seq_id)

    # -- plumbing ---------------------------------------------------------------

    def _observe(
        self, method: str, context: grpc.ServicerContext, fn: Callable[[], T], *, wait_unknown: bool = True
    ) -> T:
        start = time.perf_counter()
        try:
            return self.engine.awaiting_open(fn) if wait_unknown else fn()
        except Exception as exc:  # every failure becomes a status; the server keeps serving
            self._fail(method, context, exc)
        finally:
            self.metrics.rpc_latency.labels(method).observe(time.perf_counter() - start)

    def _stream(self, method: str, context: grpc.ServicerContext, gen: Iterable[T]) -> Iterator[T]:
        start = time.perf_counter()
        try:
            yield from gen
        except Exception as exc:
            self._fail(method, context, exc)
        finally:
            self.metrics.rpc_latency.labels(method).observe(time.perf_counter() - start)

    def _fail(self, method: str, context: grpc.ServicerContext, exc: Exception) -> NoReturn:
        code, details = abort_details(context, method, exc)
        self.metrics.rpc_errors.labels(method, code.name).inc()
        context.abort(code, details)
        raise AssertionError("unreachable: context.abort raises")

    @staticmethod
    def _attention_response(out: Any, want_mass: bool) -> pb.AttendResponse:
        resp = pb.AttendResponse(out=tensors.encode(out.out, "out"), lse=tensors.encode(out.lse, "lse"))
        if want_mass and out.block_mass is not None:
            resp.block_mass.CopyFrom(tensors.encode(out.block_mass, "block_mass"))
        return resp

    # -- sequences --------------------------------------------------------------

    def Open(self, request: pb.OpenRequest, context: grpc.ServicerContext) -> pb.OpenResponse:
        def run() -> pb.OpenResponse:
            self._admin(context, "Open")
            return self._open(request)

        return self._observe("Open", context, run)

    def OpenSigned(self, request: pb.SignedOpen, context: grpc.ServicerContext) -> pb.OpenResponse:
        def run() -> pb.OpenResponse:
            r = request
            self.gate.check_order(self._creds(context), r.order, r.tag, r.node_id, r.epoch, r.expires_at)
            digest = order_digest(r.order)
            prior = self._orders.prior(digest, self.engine.manager.seqs.__contains__)
            if prior is not None:  # the worker's retry after a lost reply
                return prior
            try:
                order = pb.OpenRequest.FromString(r.order)
            except DecodeError:
                raise InvalidArgument("the open order is not an OpenRequest") from None
            if self.gate.trust.keys is not None:  # sealed by the coordinator (protos/tickets.py)
                where = (r.node_id, r.epoch, r.expires_at, order.seq_id)
                order.tenant_salt = unseal_salt(self.gate.trust.keys, order.tenant_salt, r.tag, *where)
            reply = self._open(order, r)
            self._orders.ran(digest, r.expires_at, order.seq_id, reply)
            return reply

        return self._observe("OpenSigned", context, run)

    def _open(self, request: pb.OpenRequest, carrier: pb.SignedOpen | None = None) -> pb.OpenResponse:
        """A node Open; `carrier`: the signed order it came in, whose worker carried the
        prompt when the order names it (OpenRequest.prompt_key)."""
        self.gate.opened(request.seq_id)
        limit = request.max_cached_tokens if request.HasField("max_cached_tokens") else None
        exact = request.expect_cached_tokens if request.HasField("expect_cached_tokens") else None
        named = None
        if request.HasField("prompt_tokens"):
            ids, named = self._named_prompt(request, carrier), (request.prompt_tokens, request.prompt_key)
        else:
            ids = np.asarray(request.token_ids)  # one C-level copy, not a Python list
        max_blocks = request.max_blocks if request.HasField("max_blocks") else None
        attention = from_messages(request.attention, self.engine.spec.num_layers)
        first, salt = request.first_position, request.tenant_salt
        res = self._with_allowance(
            request.seq_id,
            max_blocks,
            lambda: self.engine.open(request.seq_id, ids, salt, limit, exact, attention, first, named),
        )
        hits = res.num_host_hit_tokens
        return pb.OpenResponse(num_cached_tokens=res.num_cached_tokens, num_host_hit_tokens=hits)

    @staticmethod
    def _named_prompt(request: pb.OpenRequest, carrier: pb.SignedOpen | None) -> np.ndarray:
        """The cached prefix of a prompt the order names, from the tokens the worker carried
        (engine.open checks they hash to the order's key)."""
        where = f"open order of {request.seq_id!r}"
        want = request.expect_cached_tokens
        if carrier is None or not request.HasField("expect_cached_tokens") or request.token_ids:
            raise InvalidArgument(f"{where}: names its prompt but is not a signed order of a cached prefix")
        carried = tokens_of(carrier, where)
        if not 0 <= want <= request.prompt_tokens or len(carried) < want:
            raise InvalidArgument(
                f"{where}: its cached prefix is {want} of {request.prompt_tokens} tokens; "
                f"the worker carried {len(carried)}"
            )
        return np.asarray(carried[:want], dtype=np.int64)

    def _with_allowance(self, seq_id: str, max_blocks: int | None, create: Callable[[], T]) -> T:
        """create() a sequence with its quota allowance in place first (a data call may
        follow at once); the previous one is restored when create fails."""
        if max_blocks is None:
            return create()
        before = self.gate.allowance(seq_id)
        self.gate.set_allowance(seq_id, max_blocks)
        try:
            return create()
        except BaseException:
            self.gate.set_allowance(seq_id, before)
            raise

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        def run() -> pb.LookupResponse:
            self._admin(context, "Lookup")
            ids = np.asarray(request.token_ids)
            return pb.LookupResponse(num_cached_tokens=self.engine.lookup(ids, request.tenant_salt))

        return self._observe("Lookup", context, run)

    def Append(self, request_iterator: Iterator[pb.AppendChunk], context: grpc.ServicerContext) -> Any:
        def run() -> pb.AppendResponse:
            try:
                return receive()
            except PagedKVError:
                # Read the rest of the stream (discarding it) before failing: aborting
                # while the client still sends can reach an asyncio client as a bare
                # INTERNAL "Internal error from Core" instead of our status (seen in CI).
                for _ in request_iterator:
                    pass
                raise

        def receive() -> pb.AppendResponse:
            first = next(request_iterator, None)
            if first is None or not first.HasField("header"):
                raise InvalidArgument("Append: the first message must carry the header")
            head = first.header
            # before a byte of the payload is buffered: who asks, then how much
            self.gate.require(self._creds(context), [head.seq_id], RIGHT_WRITE, "Append")
            tokens = list(head.token_ids)
            self._check_kv_header(head.kv, len(tokens))
            reader = tensors.SlabReader(head.kv.dtype, head.kv.shape, "kv")
            slabs = [reader.add(first.num_tokens, first.data)]
            for chunk in request_iterator:
                if chunk.HasField("header"):
                    raise InvalidArgument("Append: only the first message may carry a header")
                slabs.append(reader.add(chunk.num_tokens, chunk.data))
            reader.finish()
            pairs = [(slab[0], slab[1]) for slab in slabs]

            def append() -> None:
                with self.gate.charging([head.seq_id], [len(tokens)], self._held, self._spec.block_size):
                    self.engine.append_slabs(head.seq_id, tokens, pairs)

            self.engine.awaiting_open(append)
            return pb.AppendResponse(num_tokens=self.engine.sequence_length(head.seq_id))

        return self._observe("Append", context, run, wait_unknown=False)  # run() consumes the stream

    def _check_kv_header(self, header: pb.TensorHeader, num_tokens: int) -> None:
        """Refuse a wrong or oversized payload from its header, before buffering it."""
        s = self._spec
        want = [2, s.num_layers, num_tokens, s.num_kv_heads, s.head_dim]
        if header.dtype != s.dtype:
            raise InvalidArgument(f"kv has dtype {header.dtype!r}, this node serves {s.dtype}")
        if list(header.shape) != want:
            raise InvalidArgument(f"kv has shape {list(header.shape)}, expected {want} (2, layers, n, ...)")
        need = -(-num_tokens // s.block_size)
        total = self.engine.config.num_blocks
        if need > total:
            raise CapacityExceeded(f"append {num_tokens} tokens (more than the whole pool)", need, total)

    def Attend(self, request: pb.AttendRequest, context: grpc.ServicerContext) -> pb.AttendResponse:
        def run() -> pb.AttendResponse:
            ids, mass, flags = list(request.seq_ids), request.return_block_mass, list(request.appends) or None
            appends = request.HasField("k") and request.layer == 0 and bool(request.token_ids)
            self.gate.require(self._creds(context), ids, _rights(request.HasField("k")), "Attend")
            rows = [True] * len(ids) if flags is None else flags
            if len(rows) != len(ids):
                raise InvalidArgument(f"appends: {len(rows)} flags for {len(ids)} sequences")
            new_tokens = [int(appends and row) for row in rows]
            with self.gate.charging(ids, new_tokens, self._held, self._spec.block_size):
                out = self.engine.attend_decode(
                    ids, request.layer, *_qkv(request), return_block_mass=mass, appends=flags
                )
            return self._attention_response(out, request.return_block_mass)

        return self._observe("Attend", context, run)

    def AttendPrefill(
        self, request: pb.AttendPrefillRequest, context: grpc.ServicerContext
    ) -> pb.AttendResponse:
        def run() -> pb.AttendResponse:
            seq_id, mass = request.seq_id, request.return_block_mass
            appends = len(request.token_ids) if request.HasField("k") and request.layer == 0 else 0
            self.gate.require(self._creds(context), [seq_id], _rights(request.HasField("k")), "AttendPrefill")
            with self.gate.charging([seq_id], [appends], self._held, self._spec.block_size):
                at = request.query_position if request.HasField("query_position") else None
                out = self.engine.attend_prefill(
                    seq_id, request.layer, *_qkv(request), return_block_mass=mass, query_position=at
                )
            return self._attention_response(out, request.return_block_mass)

        return self._observe("AttendPrefill", context, run)

    def AttendPrefillBatch(
        self, request: pb.AttendPrefillBatchRequest, context: grpc.ServicerContext
    ) -> pb.AttendResponse:
        def run() -> pb.AttendResponse:
            ids, counts = list(request.seq_ids), list(request.num_tokens)
            has_k = request.HasField("k")
            self.gate.require(self._creds(context), ids, _rights(has_k), "AttendPrefillBatch")
            appends = counts if has_k and request.layer == 0 and len(counts) == len(ids) else [0] * len(ids)
            with self.gate.charging(ids, appends, self._held, self._spec.block_size):
                out = self.engine.attend_prefill_batch(ids, request.layer, counts, *_qkv(request))
            return self._attention_response(out, False)

        return self._observe("AttendPrefillBatch", context, run)

    def Fork(self, request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.Empty:
        def run() -> pb.Empty:
            self._admin(context, "Fork")
            max_blocks = request.max_blocks if request.HasField("max_blocks") else None
            child = request.child_id
            self._with_allowance(child, max_blocks, lambda: self.engine.fork(request.parent_id, child))
            return pb.Empty()

        return self._observe("Fork", context, run)

    def Free(self, request: pb.SeqRequest, context: grpc.ServicerContext) -> pb.Empty:
        def run() -> pb.Empty:
            self.gate.require_free(self._creds(context), request.seq_id)
            keep = request.keep_prefix if request.HasField("keep_prefix") else None
            self.engine.free(request.seq_id, keep)
            self.gate.drop(request.seq_id)
            return pb.Empty()

        return self._observe("Free", context, run)

    def SwapOut(self, request: pb.SeqRequest, context: grpc.ServicerContext) -> pb.SwapResponse:
        def run() -> pb.SwapResponse:
            self._admin(context, "SwapOut")
            return pb.SwapResponse(num_blocks=self.engine.swap_out(request.seq_id))

        return self._observe("SwapOut", context, run)

    def SwapIn(self, request: pb.SeqRequest, context: grpc.ServicerContext) -> pb.SwapResponse:
        def run() -> pb.SwapResponse:
            self._admin(context, "SwapIn")
            return pb.SwapResponse(num_blocks=self.engine.swap_in(request.seq_id))

        return self._observe("SwapIn", context, run)

    def ReadKV(self, request: pb.ReadKVRequest, context: grpc.ServicerContext) -> Iterator[pb.KVChunk]:
        def gen() -> Iterator[pb.KVChunk]:
            self.gate.require(self._creds(context), [request.seq_id], RIGHT_READ, "ReadKV")
            end = request.end if request.HasField("end") else None
            chunk_bytes = request.chunk_bytes or tensors.CHUNK_BYTES
            if not 0 < chunk_bytes <= tensors.MAX_MESSAGE_BYTES // 2:
                raise InvalidArgument(
                    f"chunk_bytes {chunk_bytes} outside (0, {tensors.MAX_MESSAGE_BYTES // 2}]"
                )
            # One slab of whole tokens per message, read as it is sent: the node never
            # builds the whole range (nor does the client). Positions are append-only,
            # so the range read stays valid across slabs unless the sequence is freed.
            seq_id, start = request.seq_id, request.start
            length = self.engine.awaiting_open(lambda: self.engine.cache_length(seq_id))
            stop = length if end is None else end
            if not 0 <= start <= stop <= length:
                raise InvalidArgument(
                    f"range [{start}, {end}) outside sequence {seq_id!r} of {length} tokens"
                )
            s = self._spec
            header = pb.TensorHeader(
                dtype=s.dtype, shape=[2, s.num_layers, stop - start, s.num_kv_heads, s.head_dim]
            )
            step = tensors.tokens_per_chunk(s.bytes_per_token, chunk_bytes)
            pos = start
            while True:
                upto = min(stop, pos + step)
                k, v = self.engine.read_kv(seq_id, pos, upto)
                data = tensors.byte_view(torch.stack((k, v)), "kv")[2].tobytes()
                msg = pb.KVChunk(data=data, num_tokens=upto - pos)
                if pos == start:
                    msg.header.CopyFrom(header)
                yield msg
                pos = upto
                if pos >= stop:
                    break

        return self._stream("ReadKV", context, gen())

    # -- prefixes, budgets ------------------------------------------------------

    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        def run() -> pb.PinResponse:
            self._admin(context, "Pin")
            return pb.PinResponse(num_tokens=self.engine.pin(list(request.token_ids), request.tenant_salt))

        return self._observe("Pin", context, run)

    def Unpin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        def run() -> pb.PinResponse:
            self._admin(context, "Unpin")
            return pb.PinResponse(num_tokens=self.engine.unpin(list(request.token_ids), request.tenant_salt))

        return self._observe("Unpin", context, run)

    def SetBudget(self, request: pb.SetBudgetRequest, context: grpc.ServicerContext) -> pb.Empty:
        def run() -> pb.Empty:
            self.gate.require(self._creds(context), [request.seq_id], RIGHT_WRITE, "SetBudget")
            self.engine.set_budget(
                request.seq_id,
                request.max_tokens if request.HasField("max_tokens") else None,
                request.sink_blocks if request.HasField("sink_blocks") else 1,
                request.recent_blocks if request.HasField("recent_blocks") else 4,
            )
            return pb.Empty()

        return self._observe("SetBudget", context, run)

    def BlockMass(self, request: pb.BlockMassRequest, context: grpc.ServicerContext) -> pb.BlockMassResponse:
        def run() -> pb.BlockMassResponse:
            self.gate.require(self._creds(context), [request.seq_id], RIGHT_READ, "BlockMass")
            if request.accumulated:
                scores, held = self.engine.budget_scores(request.seq_id)
                return pb.BlockMassResponse(mass=scores, num_cached_tokens=held)
            parts = [
                (m.layer, tensors.decode(m.q, f"queries[{i}].q", copy=False), m.lse, m.visible)
                for i, m in enumerate(request.queries)
            ]
            return pb.BlockMassResponse(mass=self.engine.block_mass(request.seq_id, parts))

        return self._observe("BlockMass", context, run)

    def DropBlocks(
        self, request: pb.DropBlocksRequest, context: grpc.ServicerContext
    ) -> pb.DropBlocksResponse:
        def run() -> pb.DropBlocksResponse:
            self.gate.require(self._creds(context), [request.seq_id], RIGHT_WRITE, "DropBlocks")
            kept = self.engine.drop_blocks(request.seq_id, list(request.indices))
            return pb.DropBlocksResponse(num_cached_tokens=kept)

        return self._observe("DropBlocks", context, run)

    # -- introspection ----------------------------------------------------------

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.StatsResponse:
        def run() -> pb.StatsResponse:
            s = self._spec
            return pb.StatsResponse(
                counters=self.engine.stats(),
                spec=pb.ModelSpec(
                    num_layers=s.num_layers,
                    num_kv_heads=s.num_kv_heads,
                    head_dim=s.head_dim,
                    dtype=s.dtype,
                    block_size=s.block_size,
                    model=s.model,
                ),
                device=str(self.engine.device),
                policy=self.engine.config.policy,
                bulk_port=self.bulk_port,
                epoch=self.gate.epoch or 0,
                is_fenced=self.gate.is_fenced,
            )

        return self._observe("Stats", context, run)

    def CheckIntegrity(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.CheckIntegrityResponse:
        def run() -> pb.CheckIntegrityResponse:
            try:
                self.engine.check_integrity()
            except IntegrityError as exc:
                return pb.CheckIntegrityResponse(ok=False, message=str(exc))
            return pb.CheckIntegrityResponse(ok=True)

        return self._observe("CheckIntegrity", context, run)

    def Ping(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        return self._observe("Ping", context, pb.Empty)


class NodeServer(GrpcServer):
    """A started-or-not node server with its health servicer, metrics and bulk
    KV listener (None when off)."""

    def __init__(
        self,
        server: grpc.Server,
        health_servicer: Any,
        metrics: NodeMetrics,
        bulk: BulkServer | None = None,
        gate: Gate | None = None,
    ) -> None:
        super().__init__(server, health_servicer, [SERVICE_NAME])
        self.metrics = metrics
        self.bulk = bulk
        self.gate = gate or Gate()

    def start(self) -> NodeServer:
        if self.bulk is not None:
            self.bulk.start()
        super().start()
        return self

    def stop(self, grace_s: float | None = 5.0) -> None:
        """As GrpcServer.stop; the bulk listener closes after the gRPC drain."""
        super().stop(grace_s)
        if self.bulk is not None:
            self.bulk.stop()


def create_server(
    engine: CacheEngine,
    address: str = "127.0.0.1:0",
    *,
    max_workers: int = 16,
    metrics: NodeMetrics | None = None,
    bulk_port: int | None = 0,
    trust: NodeTrust | None = None,
    tls: TlsConfig | None = None,
    bulk_limits: BulkLimits | None = None,
) -> tuple[NodeServer, int]:
    """A node server for `engine` bound to `address` (not yet started) and its port.

    `metrics` collects RPC latency/errors and derives block metrics from
    engine.stats(); a private registry is made when none is given. `bulk_port`:
    the bulk KV listener's port on the same host (0: any free port, None: off),
    advertised in Stats. `trust`: what callers must present (gate.py; default:
    nothing, a trusted network); `tls`: TLS on the gRPC port and the bulk TCP port."""
    if metrics is None:
        metrics = NodeMetrics()
    metrics.attach_engine(engine.stats, engine.config.policy)
    gate = Gate(trust)
    engine.open_grace = gate.open_grace_s  # a ticketed id's Open gets a lease to arrive
    engine.missing = gate.missing  # and if it never does, the sequence was lost
    servicer = CacheNodeServicer(engine, metrics, gate)
    server, health_servicer, port = build_server(
        lambda s: pb_grpc.add_CacheNodeServicer_to_server(servicer, s),
        [SERVICE_NAME],
        address,
        max_workers=max_workers,
        options=SERVER_OPTIONS,
        tls=tls,
    )
    bulk = (
        None
        if bulk_port is None
        else BulkServer(
            engine, bulk_host(address), bulk_port, metrics=metrics, gate=gate, tls=tls, limits=bulk_limits
        )
    )
    servicer.bulk_port = 0 if bulk is None else bulk.port
    return NodeServer(server, health_servicer, metrics, bulk, gate), port


def _rights(appends: bool) -> int:
    return RIGHT_READ | RIGHT_WRITE if appends else RIGHT_READ


def _qkv(msg: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None]:
    """An attend request's q, k, v (viewing the message's bytes) and token ids."""
    k, v = (tensors.decode(getattr(msg, f), f, copy=False) if msg.HasField(f) else None for f in ("k", "v"))
    return tensors.decode(msg.q, "q", copy=False), k, v, list(msg.token_ids) or None
