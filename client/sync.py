"""CacheClient: the synchronous user-facing API, and its Sequence handle.

    with CacheClient(coordinator="coord:50050", token="...") as client:   # a cluster
    # or CacheClient("node:50051")                                          # one node, no coordinator
        with client.open("req-1", prompt_ids) as seq:      # reuses the cached prefix
            seq.append(prompt_ids[seq.num_cached_tokens:], k, v)  # [layers, n, kv_heads, D]
            out = seq.attend(layer, q, k_new, v_new, token_id)     # one decode step, one layer
        # closing the sequence frees it on the node

In a cluster, open() returns as soon as the coordinator has placed the sequence
(seq.num_cached_tokens is exact: the node takes exactly that many cached tokens);
the node opens it in the background. In the rare case the node evicted part of
that prefix meanwhile, the first data call raises PrefixEvicted (an OpenFailed):
the sequence does not exist, so open it again and append what the new open says
is not cached (`except OpenFailed: seq = client.open(...)`).

A decode step for many sequences on one node is one RPC per layer:
`client.attend_batch(seqs, layer, q, k, v, token_ids)`.

Control calls go through a routing plane (routing.py: the coordinator, or the
one node in direct mode); data calls go straight to the node each sequence
lives on (NodeData), never through the coordinator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.attention import LayerAttention, check_layers, to_messages
from ..protos.errors import CapacityExceeded, InvalidArgument
from ..protos.spec import ModelSpec
from . import channels, codec
from .batching import BatchPart, PrefillPart, check_counts, gather_rows, split_batch, split_prefill_batch
from .config import ClientConfig
from .control import NodeControl
from .data import Explain, NodeData
from .extents import attend_batch, exchange_each, run_parallel, spill_and_retry
from .routing import CoordinatorRouting, DirectRouting
from .sequence import Sequence
from .transport.tickets import Wallet
from .types import AttentionResult, ClusterStats, NodeStats, Route

__all__ = [
    "BatchPart",
    "CacheClient",
    "NodeHandle",
    "PrefillPart",
    "Sequence",
    "split_batch",
    "split_prefill_batch",
]
MAX_EXTENT_THREADS = 8  # parallel node calls of one sharded step (one per node it spans)


class NodeHandle:
    """Control and data calls to one node, over a shared channel, with the credentials
    held for it (the coordinator's tickets, or a standalone node's token)."""

    def __init__(
        self,
        address: str,
        config: ClientConfig,
        token: str = "",
        explain: Explain | None = None,
    ) -> None:
        """explain: what the routing adds to a data call's error (NodeData)."""
        self.address = address
        stub = pb_grpc.CacheNodeStub(channels.acquire(address, config))
        self.wallet = Wallet(token)
        self.control = NodeControl(stub, config, self.wallet)
        self.data = NodeData(
            stub, config, where=f"node {address}", address=address, wallet=self.wallet, explain=explain
        )
        self._spec: ModelSpec | None = None

    def model_spec(self, timeout_s: float | None = None) -> ModelSpec:
        """The shape the node serves (asked once, then kept: a node serves one for life)."""
        if self._spec is None:
            self._spec = self.control.stats(timeout_s).spec
        return self._spec

    def hold(self, seq_id: str, route: Route) -> None:
        """Keep what the coordinator answered for seq_id: its id and ticket on this node."""
        if route.node_seq_id or route.ticket:
            self.wallet.add(seq_id, route.node_seq_id, route.ticket)


class _Step(NamedTuple):
    """A decode step's arguments, as attend_batch() took them."""

    layer: int
    q: Any
    k: Any
    v: Any
    token_ids: codec.TokenIds | None
    return_block_mass: bool
    timeout_s: float | None


def _count_appended(handles: list[Sequence], counts: Seq[int]) -> None:
    """The handles' known lengths after an append of counts[i] tokens to each (layer 0)."""
    for s, n in zip(handles, counts, strict=True):
        if s.num_tokens is not None:
            s.num_tokens += int(n)


class CacheClient:
    """Synchronous client of a pagedkv cluster (`coordinator=`) or of one node (`address`).

    In a cluster the coordinator authenticates `token` (its tenant salts the
    block keys) and places each sequence; `spec` restricts placement to nodes
    serving that model shape. With one node and no coordinator the client's
    `config.tenant_salt` is used as is (a trusted caller)."""

    def __init__(
        self,
        address: str | None = None,
        config: ClientConfig | None = None,
        *,
        coordinator: str | None = None,
        token: str | None = None,
        spec: ModelSpec | None = None,
    ) -> None:
        if (address is None) == (coordinator is None):
            raise InvalidArgument("CacheClient needs a node address or coordinator=, not both")
        self.config = config if config is not None else ClientConfig()
        self._nodes: dict[str, NodeHandle] = {}
        self._nodes_lock = threading.Lock()
        self.address = address or coordinator or ""
        self.routing: DirectRouting | CoordinatorRouting
        self._token = ""  # a standalone node's bearer token (direct mode)
        # In a cluster a data call's NOT_FOUND or Unavailable asks the coordinator whether the
        # sequence was lost (the node cannot say: routing.py); a lone node has no one to ask.
        self._explain: Explain | None = None
        if coordinator is not None:
            channel = channels.acquire(coordinator, self.config)
            self.routing = CoordinatorRouting(
                pb_grpc.CoordinatorStub(channel),
                self.config,
                token,
                spec,
                open_on_node=self._open_on_node if self.config.worker_opens else None,
                address=coordinator,
            )
            self._explain = self.routing.explain
        else:
            self._token = token or ""
            node = self.node(self.address)
            self.routing = DirectRouting(node.control, self.address, node.data)
        self._is_closed = False
        self._pool: ThreadPoolExecutor | None = None
        # spills: extents this client added; sharded_steps / sharded_attends: attend calls (one
        # layer) over several extents, and the node calls they made; window_skipped_attends: the
        # extents they did not attend, outside every query's window or chunk; budget_dropped_blocks:
        # blocks dropped by budgets this client keeps over several nodes (client/metrics.py)
        self.counters = dict.fromkeys(
            ("spills", "sharded_steps", "sharded_attends", "window_skipped_attends", "budget_dropped_blocks"),
            0,
        )

    def pool(self) -> ThreadPoolExecutor:
        """The threads a sharded step's node calls run on in parallel (made on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_EXTENT_THREADS, thread_name_prefix="pagedkv-extents")
        return self._pool

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.routing, CoordinatorRouting)

    @property
    def control(self) -> NodeControl:
        """The node's control calls (stats, budgets, integrity) of a client of one node; a
        cluster client has many nodes: it raises InvalidArgument naming client.node(address)."""
        return self._one_node("control").control

    @property
    def data(self) -> NodeData:
        """The node's data calls (by node-side sequence id) of a client of one node; a cluster
        client raises InvalidArgument naming client.node(address)."""
        return self._one_node("data").data

    def _one_node(self, what: str) -> NodeHandle:
        if self.is_cluster:
            raise InvalidArgument(
                f"CacheClient.{what}: a cluster client talks to many nodes; use client.node(address).{what}"
            )
        return self.node(self.address)

    def _open_on_node(self, address: str, order: Any, timeout_s: float) -> Any:
        """The coordinator's signed node Open (client/node_opens.py), sent to the node at `address`."""
        return self.node(address).control.open_signed(order, timeout_s)

    def node(self, address: str) -> NodeHandle:
        """The (cached) handle for data calls to the node at `address`."""
        handle = self._nodes.get(address)
        if handle is None:
            with self._nodes_lock:  # one per address: the handle holds the tickets (node_opens.py's thread)
                handle = self._nodes.get(address)
                if handle is None:
                    handle = NodeHandle(address, self.config, self._token, self._explain)
                    self._nodes[address] = handle
        return handle

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        *,
        max_cached_tokens: int | None = None,
        attention: Seq[LayerAttention] | None = None,
        timeout_s: float | None = None,
        explain_miss: bool = False,
        max_extent_tokens: int | None = None,
    ) -> Sequence:
        """Open a sequence reusing the longest cached prefix of the prompt
        (seq.num_cached_tokens; seq.num_host_hit_tokens of them from its node's host tier);
        append the rest's KV next. `attention`: one LayerAttention per layer (sliding window,
        chunks, soft-cap, scale; pagedkv.protos.attention), kept by the node for every attend of
        the sequence and of its forks; None: plain causal. explain_miss=True: seq.miss says why
        the first block not served from the node's device missed (MissExplanation; in a
        cluster, else None). In a cluster a sequence that its node cannot grow (or whose
        tail reaches max_extent_tokens, a multiple of the block size) continues on another
        node (sequence.py), its attention spec (windows and chunks too) kept exact."""
        layers = check_layers(attention, len(attention or ()))  # the layer count: node and coordinator
        messages = to_messages(layers)
        res, route = self.routing.open(
            seq_id, token_ids, max_cached_tokens, timeout_s, attention=messages, explain_miss=explain_miss
        )
        return Sequence(
            self,
            seq_id,
            route,
            res.num_cached_tokens,
            res.num_host_hit_tokens,
            res.miss,
            num_tokens=res.num_cached_tokens,
            max_extent_tokens=max_extent_tokens,
            attention=layers,
        )

    def sequence(self, seq_id: str, *, timeout_s: float | None = None) -> Sequence:
        """A handle on an existing sequence, opened by any worker (in a cluster the
        coordinator says where its extents live; raises FailedPrecondition naming the node
        if one of them died). Its length is unknown to the handle until an append."""
        return Sequence(self, seq_id, self.routing.describe(seq_id, timeout_s))

    def attend_batch(
        self,
        seqs: Seq[Sequence | str],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """One decode step of one layer for a batch: q [B, q_heads, D]; k, v
        [B, kv_heads, D]; token_ids [B] at layer 0. One RPC per node the batch
        spans (usually one); rows come back in the batch's order."""
        if not self.is_cluster:  # one node: nothing to route or split
            ids = [s.seq_id if isinstance(s, Sequence) else s for s in seqs]
            return self.data.attend(
                ids, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
            )
        handles = self._handles(seqs, timeout_s)
        step = _Step(layer, q, k, v, token_ids, return_block_mass, timeout_s)
        if any(s.is_sharded or (k is not None and s._tail_room() is not None) for s in handles):
            return attend_batch(self, handles, *step)
        try:
            return self._attend_one_extent(handles, step)
        except CapacityExceeded as exc:  # (one node refused the whole call: nothing landed)
            if layer != 0 or k is None or not self._spill_full(handles, exc, timeout_s):
                raise
            return attend_batch(self, handles, *step)

    def _handles(self, seqs: Seq[Sequence | str], timeout_s: float | None) -> list[Sequence]:
        """Handles for a batch; an id (not a handle) asks the routing where it lives (in a
        cluster a coordinator call: pass handles on a hot path)."""
        return [s if isinstance(s, Sequence) else self.sequence(s, timeout_s=timeout_s) for s in seqs]

    def _spill_full(self, handles: list[Sequence], exc: CapacityExceeded, timeout_s: float | None) -> bool:
        """A decode step's append was refused for lack of room: extend every sequence whose tail
        is at a block boundary (those needed a new block). False when none could spill."""
        spilled = False
        for s in handles:
            tail = s._extent_tokens(len(s.extents) - 1)
            if s.can_spill and tail and tail % s._block_size(timeout_s) == 0:
                s.extend(timeout_s=timeout_s)
                spilled = True
        return spilled

    def _attend_one_extent(self, handles: list[Sequence], step: _Step) -> AttentionResult:
        """Every sequence on one node: one call per node the batch spans, every node's
        request sent before the replies are read. A node that cannot take its rows' tokens
        makes them spill and the step is retried for the batch (extents.attend_batch),
        without appending again the rows the other nodes took; a lone node's refusal is
        raised (the whole call refused)."""
        layer, q, k, v, token_ids, return_block_mass, timeout_s = step
        where = [(s.route.address, s.seq_id) for s in handles]
        parts = split_batch(where, q, k, v, token_ids)
        opts: dict[str, Any] = {"return_block_mass": return_block_mass, "timeout_s": timeout_s}

        def args(p: BatchPart) -> tuple[Any, ...]:
            return p.seq_ids, layer, p.q, p.k, p.v, p.token_ids

        if len(parts) == 1:
            p = parts[0]
            res = self.node(p.address).data.attend(*args(p), **opts)
        else:
            starts = [
                lambda p=p: self.node(p.address).data.start_attend(*args(p), **opts)  # type: ignore[misc]
                for p in parts
            ]
            results, errors = exchange_each(starts)
            if any(e is not None for e in errors):
                writers = [p.rows if k is not None else [] for p in parts]
                return spill_and_retry(self, handles, tuple(step), writers, errors, errors)
            res = gather_rows([(p.rows, r) for p, r in zip(parts, results, strict=True)], len(handles))
        if k is not None and layer == 0:
            _count_appended(handles, [1] * len(handles))
        return res

    def attend_prefill_batch(
        self,
        seqs: Seq[Sequence | str],
        layer: int,
        num_tokens: Seq[int],
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """Prefill of B sequences at one layer: sequence i owns the next num_tokens[i] rows of
        q [N, q_heads, D] (k, v [N, kv_heads, D]; N token ids at layer 0). One RPC per node
        the batch spans (usually one); rows come back in the request's order."""
        if not self.is_cluster:  # one node: nothing to route or split
            check_counts(num_tokens, len(seqs))
            ids = [s.seq_id if isinstance(s, Sequence) else s for s in seqs]
            return self.data.attend_prefill_batch(
                ids, layer, num_tokens, q, k, v, token_ids, timeout_s=timeout_s
            )
        handles = self._handles(seqs, timeout_s)
        check_counts(num_tokens, len(handles))
        if any(s.is_sharded or (k is not None and s._tail_room() is not None) for s in handles):
            return self._prefill_sharded(handles, layer, num_tokens, q, k, v, token_ids, timeout_s)
        where = [(s.route.address, s.seq_id) for s in handles]
        parts = []
        for p in split_prefill_batch(where, num_tokens, q, k, v, token_ids):
            data = self.node(p.address).data
            res = data.attend_prefill_batch(
                p.seq_ids, layer, p.num_tokens, p.q, p.k, p.v, p.token_ids, timeout_s=timeout_s
            )
            parts.append((p.rows, res))
        if k is not None and layer == 0:
            _count_appended(handles, num_tokens)
        return parts[0][1] if len(parts) == 1 else gather_rows(parts, sum(len(r) for r, _ in parts))

    def _prefill_sharded(
        self,
        handles: list[Sequence],
        layer: int,
        num_tokens: Seq[int],
        q: Any,
        k: Any,
        v: Any,
        token_ids: codec.TokenIds | None,
        timeout_s: float | None,
    ) -> AttentionResult:
        """A prefill batch with sequences over several nodes: each sequence's own prefill
        (sequence.py), the sequences in parallel, rows back in the request's order."""
        tokens = None if token_ids is None else codec.token_list(token_ids)
        bounds = [0]
        for n in num_tokens:
            bounds.append(bounds[-1] + int(n))
        calls: list[Callable[[], AttentionResult]] = []
        for i, s in enumerate(handles):
            a, b = bounds[i], bounds[i + 1]

            def call(s: Sequence = s, a: int = a, b: int = b) -> AttentionResult:
                return s.attend_prefill(
                    layer,
                    q[a:b],
                    None if k is None else k[a:b],
                    None if v is None else v[a:b],
                    None if tokens is None else tokens[a:b],
                    timeout_s=timeout_s,
                )

            calls.append(call)
        parts = run_parallel(self.pool(), calls)
        return AttentionResult(torch.cat([p.out for p in parts]), torch.cat([p.lse for p in parts]))

    def lookup(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        """Leading tokens of this prompt cached (on the best node, in a cluster). Changes nothing."""
        return self.routing.lookup(token_ids, timeout_s)

    def pin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return self.routing.pin(token_ids, timeout_s)

    def unpin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return self.routing.unpin(token_ids, timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> NodeStats:
        """The node's stats (direct mode). In a cluster see cluster_stats() and node_stats()."""
        if isinstance(self.routing, CoordinatorRouting):
            raise InvalidArgument("stats() is per node: use cluster_stats() or node_stats(address)")
        return self.control.stats(timeout_s)

    def cluster_stats(self, *, timeout_s: float | None = None) -> ClusterStats:
        if not isinstance(self.routing, CoordinatorRouting):
            raise InvalidArgument("cluster_stats() needs a client made with coordinator=")
        return self.routing.stats(timeout_s)

    def node_stats(self, address: str, *, timeout_s: float | None = None) -> NodeStats:
        return self.node(address).control.stats(timeout_s)

    def _addresses(self, timeout_s: float | None) -> list[str]:
        if isinstance(self.routing, CoordinatorRouting):
            return [n.address for n in self.routing.stats(timeout_s).nodes]
        return [self.address]

    def check_integrity(self, *, timeout_s: float | None = None) -> None:
        """Raise IntegrityError with a node's message when one of its invariants fails (every node)."""
        for address in self._addresses(timeout_s):
            self.node(address).control.check_integrity(timeout_s)

    def ping(self, *, timeout_s: float | None = None) -> None:
        for address in self._addresses(timeout_s):
            self.node(address).control.ping(timeout_s)

    def connect(self, *, timeout_s: float | None = None) -> None:
        """Open now the connections the first requests would otherwise open: for every
        node (the coordinator's live ones in a cluster), its gRPC channel (a Ping) and
        its bulk channel's TCP and same-host connections with the shared region mapped.
        Optional: a worker calls it at start-up so that its first request does not pay
        the set-up (tens of ms). Raises what the Ping raises for a node that is down."""
        for address in self._addresses(timeout_s):
            handle = self.node(address)
            handle.control.ping(timeout_s)
            handle.data.connect(timeout_s)

    def close(self) -> None:
        """Give the shared channels back (each closed when its last user closes)."""
        if not self._is_closed:
            self._is_closed = True
            if isinstance(self.routing, CoordinatorRouting):
                if self.routing.node_opens is not None:
                    self.routing.node_opens.close()  # the page-table drops of failed node Opens
                if self.routing.framed is not None:
                    self.routing.framed.close()
                channels.release(self.address, self.config)
            for address, handle in self._nodes.items():
                handle.data.close()  # its bulk connections
                channels.release(address, self.config)
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
