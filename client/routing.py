"""Where control calls go, and where each sequence lives.

Two planes with one surface (the asyncio client runs these on its threads):
- Direct*: one node is the whole cache (no coordinator); its address is every
  sequence's route; the tenant salt is the client's own (trusted callers only).
  Open goes by the node's data path (NodeData.open: its bulk channel when it has
  one, the Open rpc otherwise): every request pays one Open before its first token.
- Coordinator*: the coordinator places sequences, keeps their page tables and
  sets the tenant salt from the bearer token; data calls then go straight to
  the node it names (Route), never through it.

Every method takes a deadline; errors come back as pagedkv.protos.errors.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import (
    InvalidArgument,
    PagedKVError,
    PrefixUnknown,
    SequenceLost,
    SequenceNotFound,
    Unavailable,
)
from ..protos.framed_client import FramedPort, NotCarried
from ..protos.prompt import PACKED_TOKEN_BYTES
from ..protos.spec import ModelSpec
from . import codec
from .config import ClientConfig
from .control import NodeControl, call
from .data import NodeData
from .node_opens import NodeOpens, Send
from .sent_prompts import SentPrompts
from .types import ClusterStats, ExtentRoute, MissExplanation, NodeEntry, OpenResult, Route

_EMPTY = pb.Empty()
EXPLAIN_TIMEOUT_S = 5.0  # the most a data call's NOT_FOUND waits for the coordinator's word on it
# The calls the coordinator's framed port takes from a worker, and their reply types.
FRAMED_REPLIES = {"Open": pb.CoordOpenResponse, "Close": pb.Empty}
INFLIGHT_FIRST_PAUSE_S, INFLIGHT_MAX_PAUSE_S = 0.01, 0.16  # _await_in_flight's backoff
LOSS_CHECK_TIMEOUT_S = 1.0  # and its Unavailable (a plain page-table read: ms when it answers)


class DirectRouting:
    def __init__(self, node: NodeControl, address: str, data: NodeData) -> None:
        self.node, self.data = node, data
        self.route = Route("", address)

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached_tokens: int | None,
        timeout_s: float | None,
        attention: Sequence[pb.LayerAttention] = (),
        explain_miss: bool = False,
    ) -> tuple[OpenResult, Route]:
        # explain_miss: a lone node has no cluster index to explain from (miss stays None)
        return self.data.open(seq_id, token_ids, max_cached_tokens, timeout_s, attention), self.route

    def describe(self, seq_id: str, timeout_s: float | None = None) -> list[ExtentRoute]:
        return [ExtentRoute(self.route, 0)]

    def fork(self, parent_id: str, child_id: str, timeout_s: float | None = None) -> list[ExtentRoute]:
        self.node.fork(parent_id, child_id, timeout_s)
        return [ExtentRoute(self.route, 0)]

    def extend(
        self, seq_id: str, num_tokens: int, timeout_s: float | None = None, attention: Any = ()
    ) -> list[ExtentRoute]:
        raise InvalidArgument(
            f"sequence {seq_id!r}: a client of one node has no other node to extend it to (use a cluster)"
        )

    def close(self, seq_id: str, timeout_s: float | None = None, keep_prefix: int | None = None) -> None:
        self.node.free(seq_id, timeout_s, keep_prefix)

    def swap_out(self, seq_id: str, timeout_s: float | None = None) -> int:
        return self.node.swap_out(seq_id, timeout_s)

    def swap_in(self, seq_id: str, timeout_s: float | None = None) -> tuple[int, list[ExtentRoute]]:
        return self.node.swap_in(seq_id, timeout_s), [ExtentRoute(self.route, 0)]

    def lookup(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        return self.node.lookup(token_ids, timeout_s)

    def pin(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        return self.node.pin(token_ids, timeout_s)

    def unpin(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        return self.node.unpin(token_ids, timeout_s)


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _spec(spec: ModelSpec | None) -> pb.ModelSpec | None:
    return pb.ModelSpec(**spec.to_dict()) if spec is not None else None


def _route(resp: pb.CoordOpenResponse) -> Route:
    first = resp.extents[0]
    return Route(first.node_id, first.address, resp.node_seq_id, first.ticket)


def _routes(resp: pb.CoordOpenResponse) -> list[ExtentRoute]:
    """Every extent the reply names, in order (one for most sequences)."""
    return [
        ExtentRoute(Route(e.node_id, e.address, resp.node_seq_id, e.ticket), int(e.first_token))
        for e in resp.extents
    ]


def _miss(resp: pb.CoordOpenResponse) -> MissExplanation | None:
    if not resp.HasField("miss"):
        return None
    m = resp.miss
    reason = pb.MissExplanation.Reason.Name(m.reason).lower()
    return MissExplanation(reason, m.first_block, m.node_id, m.policy, m.cached_elsewhere_blocks)


def cluster_stats(resp: pb.CoordStatsResponse) -> ClusterStats:
    nodes = [
        NodeEntry(
            n.node_id, n.address, ModelSpec(**{f.name: v for f, v in n.spec.ListFields()}), n.num_blocks
        )
        for n in resp.nodes
    ]
    return ClusterStats(dict(resp.counters), nodes)


class CoordinatorRouting:
    def __init__(
        self,
        stub: pb_grpc.CoordinatorStub,
        config: ClientConfig,
        token: str | None,
        spec: ModelSpec | None,
        open_on_node: Send | None = None,
        address: str = "",
    ):
        """open_on_node(address, order, timeout_s): starts the node's OpenSigned with the
        coordinator's signed node Open and returns its gRPC future (node_opens.py: the
        worker opens on the node, the coordinator spends no rpc on it); None: the
        coordinator sends it."""
        self.stub, self.config, self.spec = stub, config, spec
        self.node_opens = (
            None
            if open_on_node is None
            else NodeOpens(open_on_node, self._drop_failed_open, config.deadline_s)
        )
        self.metadata = _metadata(token)
        # Open and Close on the framed port the coordinator's replies advertise (protos/framed_client.py)
        self.framed = FramedPort(address, self.metadata, config.tls) if config.coordinator_frames else None
        self._spec_cache: tuple[ModelSpec | None, pb.ModelSpec | None] = (spec, _spec(spec))
        # Prompts go packed once a reply says the coordinator reads them (the first open: varints)
        self.packs_prompts = False
        self.sent_prompts = SentPrompts()  # what an open may name instead of sending (sent_prompts.py)

    def _spec_msg(self) -> pb.ModelSpec | None:
        """The spec as a message, built once per spec (not once per open);
        a request copies it in."""
        spec, msg = self._spec_cache
        if spec is not self.spec:
            spec, msg = self._spec_cache = (self.spec, _spec(self.spec))
        return msg

    def _t(self, timeout_s: float | None) -> float:
        return self.config.deadline_s if timeout_s is None else timeout_s

    def _open_request(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached: int | None,
        attention: Sequence[pb.LayerAttention] = (),
        explain_miss: bool = False,
    ) -> pb.CoordOpenRequest:
        packed = codec.packed_prompt(token_ids) if self.packs_prompts else None
        if packed is not None:
            req = pb.CoordOpenRequest(packed_token_ids=packed, seq_id=seq_id, spec=self._spec_msg())
        else:
            req = codec.with_token_ids(pb.CoordOpenRequest, token_ids, seq_id=seq_id, spec=self._spec_msg())
        req.request_id = uuid.uuid4().hex  # a retry of this very request gets its first answer
        if max_cached is not None:
            req.max_cached_tokens = max_cached
        if attention:
            req.attention.extend(attention)
        if explain_miss:
            req.explain_miss = True
        return req

    def _pin_request(self, token_ids: codec.TokenIds) -> pb.CoordPinRequest:
        return pb.CoordPinRequest(token_ids=codec.token_list(token_ids), spec=self._spec_msg())

    def _call(self, method: str, request: Any, timeout_s: float | None) -> Any:
        framed = self.framed
        if framed is not None and method in FRAMED_REPLIES and framed.is_usable:
            with contextlib.suppress(NotCarried):  # (then gRPC carries it)
                return framed.call(method, request, FRAMED_REPLIES[method], self._t(timeout_s))
        resp = call(getattr(self.stub, method), request, self._t(timeout_s), self.metadata, "coordinator")
        if framed is not None and type(resp) is pb.CoordOpenResponse and resp.frame_port != framed.port:
            framed.learn(resp.frame_port)
        return resp

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached_tokens: int | None,
        timeout_s: float | None,
        attention: Sequence[pb.LayerAttention] = (),
        explain_miss: bool = False,
    ) -> tuple[OpenResult, Route]:
        request = self._open_request(seq_id, token_ids, max_cached_tokens, attention, explain_miss)
        packed = request.packed_token_ids  # all of it (an open may send only its end)
        if self.node_opens is not None:
            self.node_opens.wait(seq_id)  # a reopen after a failed node Open: its page table is gone
            request.worker_opens = request.carries_prompt = True
        resp = self._open(request, packed, timeout_s)
        if resp.num_pending_tokens and self.node_opens is not None and self.config.await_in_flight_s:
            resp = self._await_in_flight(request, packed, resp, token_ids, timeout_s)
        self.packs_prompts = resp.takes_packed_prompts  # an older coordinator reads packed as empty
        if self.node_opens is not None and resp.HasField("node_open"):
            _carry_prompt(resp.node_open, request, packed, resp.num_cached_tokens)
            self.node_opens.send(seq_id, resp.extents[0].address, resp.node_open)
        return OpenResult(resp.num_cached_tokens, resp.num_host_hit_tokens, _miss(resp)), _route(resp)

    def _open(
        self, request: pb.CoordOpenRequest, packed: bytes, timeout_s: float | None
    ) -> pb.CoordOpenResponse:
        """Open; on the framed port (one coordinator process: its refs stay valid) the start
        the prompt shares with one sent lately goes as a ref (sent_prompts.py), and the open
        goes whole again if the coordinator no longer holds it."""
        _whole(request, packed)  # (a second open of this request names afresh)
        if packed and request.carries_prompt and self.framed is not None and self.framed.is_usable:
            self.sent_prompts.fill(request, packed)
        try:
            resp = self._call("Open", request, timeout_s)
        except PrefixUnknown:
            if not _whole(request, packed):
                raise
            self.sent_prompts.forget()
            resp = self._call("Open", request, timeout_s)
        if packed and request.carries_prompt:
            self.sent_prompts.learn(packed, resp)
        return resp

    def _await_in_flight(
        self,
        request: pb.CoordOpenRequest,
        packed: bytes,
        resp: pb.CoordOpenResponse,
        token_ids: codec.TokenIds,
        timeout_s: float | None,
    ) -> pb.CoordOpenResponse:
        """Another worker's open is computing part of this prompt on the chosen node: keep
        this open while the index shows none of those blocks there (Lookup, with backoff, at
        most config.await_in_flight_s), then close it (no node has seen it: the worker carries
        its node Open) and open again, once. Any failure before the close keeps this open."""
        deadline = time.monotonic() + self.config.await_in_flight_s
        node_id, have = resp.extents[0].node_id, resp.num_cached_tokens
        lookup = codec.with_token_ids(pb.CoordLookupRequest, token_ids, spec=self._spec_msg())
        pause = INFLIGHT_FIRST_PAUSE_S
        while True:
            if time.monotonic() + pause > deadline:
                return resp  # not there in time: this worker computes them
            time.sleep(pause)
            pause = min(2 * pause, INFLIGHT_MAX_PAUSE_S)
            try:
                found = self._call("Lookup", lookup, timeout_s)
                if found.node_id == node_id and found.num_cached_tokens > have:
                    self._call("Close", pb.CoordSeqRequest(seq_id=request.seq_id, freed_extents=1), timeout_s)
                    break
            except PagedKVError:  # (a store outage): keep this open
                return resp
        request.request_id = uuid.uuid4().hex  # a new open (a retry of it gets its answer)
        return self._open(request, packed, timeout_s)  # (fails as any open would)

    def _drop_failed_open(self, seq_id: str) -> None:
        """The node refused (or never got) the Open this worker carried: drop the page
        table so the id can be opened again; if the coordinator cannot be reached either,
        reconciliation marks the record lost (its node does not hold it) and it expires."""
        with contextlib.suppress(PagedKVError):
            self._call("Close", pb.CoordSeqRequest(seq_id=seq_id), None)

    def describe(self, seq_id: str, timeout_s: float | None = None) -> list[ExtentRoute]:
        return _routes(self._call("Describe", pb.CoordSeqRequest(seq_id=seq_id), timeout_s))

    def explain(self, exc: PagedKVError, seq_ids: Sequence[str] = ()) -> PagedKVError:
        """What a data call's error means for the worker; `seq_ids`: the call's sequences.

        NOT_FOUND: a node without a ticket cannot tell a sequence it lost (it restarted,
        or its open never reached it) from an id nobody opened, so the coordinator is
        asked what became of it, and it checks with the node (coordinator/missing.py):
        its SequenceLost (naming the node) when the sequence is lost; Unavailable when
        that cannot be told now (the coordinator or the node unreachable, or the open
        arrived late: retry the call); `exc` as it was for an id nobody opened or one closed.

        Unavailable: a node that is down cannot say at all, so the coordinator's page
        tables are read (plain Describe, once per call, `LOSS_CHECK_TIMEOUT_S` in all):
        a sequence recorded lost gives its SequenceLost; otherwise `exc` stands
        (the node is slow, or a suspect not yet declared dead: a retry may succeed)."""
        failed = self._failed_open(exc, seq_ids)
        if failed is not None:
            return failed
        if isinstance(exc, Unavailable):
            return self._lost(seq_ids) or exc
        seq_id = getattr(exc, "seq_id", None)
        if not isinstance(exc, SequenceNotFound) or not isinstance(seq_id, str) or not seq_id:
            return exc
        request = pb.CoordSeqRequest(seq_id=seq_id, node_not_found=True)
        try:  # (bounded: a coordinator that cannot say soon answers Unavailable)
            self._call("Describe", request, min(self._t(None), EXPLAIN_TIMEOUT_S))
        except (SequenceLost, Unavailable) as verdict:
            return verdict
        except PagedKVError:
            return exc
        return exc

    def _failed_open(self, exc: PagedKVError, seq_ids: Sequence[str]) -> PagedKVError | None:
        """The refusal of a node Open this worker carried for one of the call's sequences."""
        if self.node_opens is None:
            return None
        seq_id = getattr(exc, "seq_id", None)
        for s in (*seq_ids, *((seq_id,) if isinstance(seq_id, str) else ())):
            failed = self.node_opens.failure(s)
            if failed is not None:
                return failed
        return None

    def _lost(self, seq_ids: Sequence[str]) -> SequenceLost | None:
        """The SequenceLost the page table records for the first of `seq_ids` it knows;
        None when that one is live (the call's sequences share its node: a node declared
        dead loses them all at once), or the coordinator cannot say within the bound."""
        deadline = time.monotonic() + min(self._t(None), LOSS_CHECK_TIMEOUT_S)
        for seq_id in dict.fromkeys(seq_ids):  # (a batch may name a sequence twice)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self._call("Describe", pb.CoordSeqRequest(seq_id=seq_id), left)
            except SequenceLost as lost:
                return lost
            except Unavailable:  # the coordinator cannot say, or the node is a suspect
                break
            except PagedKVError:  # closed, or another tenant's: not this call's loss
                continue
            break  # live: its node is not declared dead
        return None

    def fork(self, parent_id: str, child_id: str, timeout_s: float | None = None) -> list[ExtentRoute]:
        return _routes(
            self._call("Fork", pb.CoordForkRequest(parent_id=parent_id, child_id=child_id), timeout_s)
        )

    def extend(
        self, seq_id: str, num_tokens: int, timeout_s: float | None = None, attention: Any = ()
    ) -> list[ExtentRoute]:
        """A new tail extent on another node, the old tail sealed at num_tokens; every extent.
        attention: the sequence's spec (LayerAttention messages) for the new extent's node."""
        request = pb.CoordExtendRequest(seq_id=seq_id, num_tokens=num_tokens, attention=attention)
        return _routes(self._call("Extend", request, timeout_s))

    def close(
        self,
        seq_id: str,
        timeout_s: float | None = None,
        keep_prefix: int | None = None,
        *,
        freed_extents: int = 0,
    ) -> None:
        """Drop the page table; freed_extents: the worker freed the sequence on the nodes of
        its first that many extents already (client/closing.py), the coordinator frees the rest."""
        # A Free that overtakes the node Open this worker sent waits for it at the node (its
        # grace for unknown ids), so the close does not wait here.
        failed = None if self.node_opens is None else self.node_opens.forget(seq_id)
        request = pb.CoordSeqRequest(seq_id=seq_id, keep_prefix=keep_prefix, freed_extents=freed_extents)
        self._call("Close", request, timeout_s)
        if failed is not None:  # as the coordinator's own failed Open: the close says why
            raise failed

    def swap_out(self, seq_id: str, timeout_s: float | None = None) -> int:
        return self._call("SwapOut", pb.CoordSeqRequest(seq_id=seq_id), timeout_s).num_blocks

    def swap_in(self, seq_id: str, timeout_s: float | None = None) -> tuple[int, list[ExtentRoute]]:
        resp = self._call("SwapIn", pb.CoordSeqRequest(seq_id=seq_id), timeout_s)
        return resp.num_blocks, _routes(resp)

    def lookup(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        req = codec.with_token_ids(pb.CoordLookupRequest, token_ids, spec=self._spec_msg())
        return self._call("Lookup", req, timeout_s).num_cached_tokens

    def pin(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        return self._call("Pin", self._pin_request(token_ids), timeout_s).num_tokens

    def unpin(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        return self._call("Unpin", self._pin_request(token_ids), timeout_s).num_tokens

    def stats(self, timeout_s: float | None = None) -> ClusterStats:
        return cluster_stats(self._call("Stats", _EMPTY, timeout_s))


def _carry_prompt(order: pb.SignedOpen, request: pb.CoordOpenRequest, packed: bytes, num_cached: int) -> None:
    """Attach the prompt's cached prefix (all the node reads of it) to the node Open: the
    order names the prompt instead of holding it (OpenRequest.prompt_key). `packed`: the
    whole prompt packed (the request may hold only its end), or b"" when it went as varints."""
    if num_cached <= 0:
        return
    if packed:
        order.packed_token_ids = packed[: PACKED_TOKEN_BYTES * num_cached]
    else:
        order.token_ids.extend(request.token_ids[:num_cached])


def _whole(request: pb.CoordOpenRequest, packed: bytes) -> bool:
    """Make an open that named its prompt's start send it whole again; False if it named none."""
    if not request.prefix_ref:
        return False
    request.ClearField("prefix_ref")
    request.ClearField("prefix_tokens")
    request.packed_token_ids = packed
    return True
