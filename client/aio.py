"""AsyncCacheClient: the asyncio twin of CacheClient (grpc.aio), same surface.

    async with AsyncCacheClient(coordinator="coord:50050", token="...") as client:
        async with client.open("req-1", prompt_ids) as seq:
            await seq.append(rest_ids, k, v)
            out = await seq.attend(layer, q, k_new, v_new, token_id)

`client.open(...)` is both awaitable (`seq = await client.open(...)`) and an
async context manager that closes the sequence on exit. Create the client
inside the running event loop (grpc.aio channels belong to their loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from collections.abc import Sequence as Seq
from typing import Any

import torch

from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import InvalidArgument, NotFound, OpenFailed
from ..protos.spec import ModelSpec
from . import channels, codec
from .config import ClientConfig
from .control import AsyncNodeControl
from .data import AsyncNodeData, NodeData
from .routing import AsyncCoordinatorRouting, AsyncDirectRouting
from .sync import (
    BatchPart,
    PrefillPart,
    _as_batch,
    _gather_rows,
    _squeeze,
    check_counts,
    split_batch,
    split_prefill_batch,
)
from .types import AttentionResult, ClusterStats, NodeStats, Route


class AsyncNodeHandle:
    """Control calls over the loop's grpc.aio channel; data calls are the sync client's
    (NodeData) on worker threads, over the process's shared sync channel."""

    def __init__(self, address: str, config: ClientConfig) -> None:
        self.address = address
        stub = pb_grpc.CacheNodeStub(channels.acquire_aio(address, config))
        self.control = AsyncNodeControl(stub, config)
        data_stub = pb_grpc.CacheNodeStub(channels.acquire(address, config))
        self.data = AsyncNodeData(NodeData(data_stub, config, where=f"node {address}", address=address))


class AsyncSequence:
    def __init__(
        self,
        client: AsyncCacheClient,
        seq_id: str,
        route: Route,
        num_cached_tokens: int = 0,
        num_host_hit_tokens: int = 0,
    ) -> None:
        self.client = client
        self.seq_id = seq_id
        self.route = route
        self.node = client.node(route.address)
        self.num_cached_tokens = num_cached_tokens
        self.num_host_hit_tokens = num_host_hit_tokens
        self.is_closed = False

    def __repr__(self) -> str:
        where = self.route.node_id or self.route.address
        return f"AsyncSequence({self.seq_id!r}, node={where}, cached={self.num_cached_tokens})"

    async def append(
        self, token_ids: codec.TokenIds, k: Any, v: Any, *, timeout_s: float | None = None
    ) -> int:
        return await self.node.data.append(self.seq_id, token_ids, k, v, timeout_s)

    async def attend(
        self,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_id: int | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        q, squeeze = _as_batch(q, 3)
        k, _ = _as_batch(k, 3)
        v, _ = _as_batch(v, 3)
        tokens = None if token_id is None else [token_id]
        res = await self.node.data.attend(
            [self.seq_id], layer, q, k, v, tokens, return_block_mass=return_block_mass, timeout_s=timeout_s
        )
        return _squeeze(res, squeeze)

    async def attend_prefill(
        self,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        return await self.node.data.attend_prefill(
            self.seq_id, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
        )

    async def fork(self, child_id: str, *, timeout_s: float | None = None) -> AsyncSequence:
        route = await self.client.routing.fork(self.seq_id, child_id, timeout_s)
        return AsyncSequence(self.client, child_id, route)

    async def read_kv(
        self,
        start: int = 0,
        end: int | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await self.node.data.read_kv(self.seq_id, start, end, timeout_s, out)

    async def swap_out(self, *, timeout_s: float | None = None) -> int:
        return await self.client.routing.swap_out(self.seq_id, timeout_s)

    async def swap_in(self, *, timeout_s: float | None = None) -> int:
        num_blocks, route = await self.client.routing.swap_in(self.seq_id, timeout_s)
        if route != self.route:
            self.route, self.node = route, self.client.node(route.address)
        return num_blocks

    async def set_budget(
        self,
        max_tokens: int | None,
        sink_blocks: int = 1,
        recent_blocks: int = 4,
        *,
        timeout_s: float | None = None,
    ) -> None:
        await self.node.control.set_budget(self.seq_id, max_tokens, sink_blocks, recent_blocks, timeout_s)

    async def close(self, *, timeout_s: float | None = None) -> None:
        """See Sequence.close."""
        if not self.is_closed:
            try:
                await self.client.routing.close(self.seq_id, timeout_s)
            except (OpenFailed, NotFound):
                self.is_closed = True
                raise
            self.is_closed = True

    async def __aenter__(self) -> AsyncSequence:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            await self.close()
        except (OpenFailed, NotFound):
            if exc_type is None:  # else the body's error (e.g. the OpenFailed itself) says it
                raise


class _Opening:
    """`await client.open(...)` or `async with client.open(...) as seq`."""

    def __init__(
        self,
        client: AsyncCacheClient,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached_tokens: int | None,
        timeout_s: float | None,
    ) -> None:
        self._args = (client, seq_id, token_ids, max_cached_tokens, timeout_s)
        self._seq: AsyncSequence | None = None

    async def _open(self) -> AsyncSequence:
        client, seq_id, token_ids, max_cached, timeout_s = self._args
        res, route = await client.routing.open(seq_id, token_ids, max_cached, timeout_s)
        return AsyncSequence(client, seq_id, route, res.num_cached_tokens, res.num_host_hit_tokens)

    def __await__(self) -> Generator[Any, None, AsyncSequence]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncSequence:
        self._seq = await self._open()
        return self._seq

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if self._seq is not None:
            await self._seq.__aexit__(exc_type, *exc)


class AsyncCacheClient:
    """asyncio client of a pagedkv cluster (`coordinator=`) or one node (`address`);
    see CacheClient. Create it inside the running event loop."""

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
            raise InvalidArgument("AsyncCacheClient needs a node address or coordinator=, not both")
        self.config = config if config is not None else ClientConfig()
        self._nodes: dict[str, AsyncNodeHandle] = {}
        self.address = address or coordinator or ""
        self.routing: AsyncDirectRouting | AsyncCoordinatorRouting
        if coordinator is not None:
            channel = channels.acquire_aio(coordinator, self.config)
            self.routing = AsyncCoordinatorRouting(pb_grpc.CoordinatorStub(channel), self.config, token, spec)
        else:
            node = self.node(self.address)
            self.routing = AsyncDirectRouting(node.control, self.address, node.data)
            self.control, self.data = node.control, node.data
        self._is_closed = False

    def node(self, address: str) -> AsyncNodeHandle:
        handle = self._nodes.get(address)
        if handle is None:
            handle = self._nodes[address] = AsyncNodeHandle(address, self.config)
        return handle

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        *,
        max_cached_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> _Opening:
        return _Opening(self, seq_id, token_ids, max_cached_tokens, timeout_s)

    async def sequence(self, seq_id: str, *, timeout_s: float | None = None) -> AsyncSequence:
        return AsyncSequence(self, seq_id, await self.routing.describe(seq_id, timeout_s))

    async def _where(self, seqs: Seq[AsyncSequence | str], timeout_s: float | None) -> list[tuple[str, str]]:
        """(node address, sequence id) of each (see CacheClient._where)."""
        return [
            (s.route.address, s.seq_id)
            if isinstance(s, AsyncSequence)
            else ((await self.routing.describe(s, timeout_s)).address, s)
            for s in seqs
        ]

    async def attend_batch(
        self,
        seqs: Seq[AsyncSequence | str],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """One decode step of one layer for a batch; one RPC per node, all nodes concurrently."""
        if isinstance(self.routing, AsyncDirectRouting):  # one node: nothing to route or split
            ids = [s.seq_id if isinstance(s, AsyncSequence) else s for s in seqs]
            return await self.data.attend(
                ids, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
            )
        split = split_batch(await self._where(seqs, timeout_s), q, k, v, token_ids)

        async def one(p: BatchPart) -> tuple[list[int], AttentionResult]:
            data = self.node(p.address).data
            res = await data.attend(p.seq_ids, layer, p.q, p.k, p.v, p.token_ids,
                                    return_block_mass=return_block_mass, timeout_s=timeout_s)  # fmt: skip
            return p.rows, res

        parts = await asyncio.gather(*(one(p) for p in split))
        return parts[0][1] if len(parts) == 1 else _gather_rows(list(parts), len(seqs))

    async def attend_prefill_batch(
        self,
        seqs: Seq[AsyncSequence | str],
        layer: int,
        num_tokens: Seq[int],
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """Prefill of B sequences at one layer (see CacheClient.attend_prefill_batch); one RPC per
        node, all nodes concurrently."""
        if isinstance(self.routing, AsyncDirectRouting):
            check_counts(num_tokens, len(seqs))
            ids = [s.seq_id if isinstance(s, AsyncSequence) else s for s in seqs]
            return await self.data.attend_prefill_batch(ids, layer, num_tokens, q, k, v, token_ids,
                                                        timeout_s=timeout_s)  # fmt: skip
        where = await self._where(seqs, timeout_s)

        async def one(p: PrefillPart) -> tuple[list[int], AttentionResult]:
            data = self.node(p.address).data
            res = await data.attend_prefill_batch(p.seq_ids, layer, p.num_tokens, p.q, p.k, p.v, p.token_ids,
                                                  timeout_s=timeout_s)  # fmt: skip
            return p.rows, res

        split = split_prefill_batch(where, num_tokens, q, k, v, token_ids)
        parts = await asyncio.gather(*(one(p) for p in split))
        return parts[0][1] if len(parts) == 1 else _gather_rows(list(parts), sum(len(r) for r, _ in parts))

    async def lookup(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self.routing.lookup(token_ids, timeout_s)

    async def pin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self.routing.pin(token_ids, timeout_s)

    async def unpin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self.routing.unpin(token_ids, timeout_s)

    async def stats(self, *, timeout_s: float | None = None) -> NodeStats:
        if isinstance(self.routing, AsyncCoordinatorRouting):
            raise InvalidArgument("stats() is per node: use cluster_stats() or node_stats(address)")
        return await self.control.stats(timeout_s)

    async def cluster_stats(self, *, timeout_s: float | None = None) -> ClusterStats:
        if not isinstance(self.routing, AsyncCoordinatorRouting):
            raise InvalidArgument("cluster_stats() needs a client made with coordinator=")
        return await self.routing.stats(timeout_s)

    async def node_stats(self, address: str, *, timeout_s: float | None = None) -> NodeStats:
        return await self.node(address).control.stats(timeout_s)

    async def _addresses(self, timeout_s: float | None) -> list[str]:
        if isinstance(self.routing, AsyncCoordinatorRouting):
            return [n.address for n in (await self.routing.stats(timeout_s)).nodes]
        return [self.address]

    async def check_integrity(self, *, timeout_s: float | None = None) -> None:
        for address in await self._addresses(timeout_s):
            await self.node(address).control.check_integrity(timeout_s)

    async def ping(self, *, timeout_s: float | None = None) -> None:
        for address in await self._addresses(timeout_s):
            await self.node(address).control.ping(timeout_s)

    async def connect(self, *, timeout_s: float | None = None) -> None:
        """CacheClient.connect: every node's gRPC channel and bulk connections opened now."""
        for address in await self._addresses(timeout_s):
            handle = self.node(address)
            await handle.control.ping(timeout_s)
            await handle.data.connect(timeout_s)

    async def close(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            if isinstance(self.routing, AsyncCoordinatorRouting):
                await channels.release_aio(self.address, self.config)
            for address, handle in self._nodes.items():
                handle.data.close()  # its bulk connections
                channels.release(address, self.config)
                await channels.release_aio(address, self.config)

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
