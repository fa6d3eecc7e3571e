"""AsyncCacheClient: the asyncio twin of CacheClient (grpc.aio), same surface.

    async with AsyncCacheClient(address) as client:
        async with client.open("req-1", prompt_ids) as seq:
            await seq.append(rest_ids, k, v)
            out = await seq.attend(layer, q, k_new, v_new, token_id)

`client.open(...)` is both awaitable (`seq = await client.open(...)`) and an
async context manager that closes the sequence on exit.
"""

from __future__ import annotations

from collections.abc import Generator
from collections.abc import Sequence as Seq
from typing import Any

import torch

from ..protos import pagedkv_pb2_grpc as pb_grpc
from . import channels, codec
from .config import ClientConfig
from .control import AsyncNodeControl
from .data import AsyncNodeData
from .sync import _as_batch, _squeeze
from .types import AttentionResult, NodeStats


class AsyncSequence:
    def __init__(
        self, client: AsyncCacheClient, seq_id: str, num_cached_tokens: int = 0, num_host_hit_tokens: int = 0
    ) -> None:
        self.client = client
        self.seq_id = seq_id
        self.num_cached_tokens = num_cached_tokens
        self.num_host_hit_tokens = num_host_hit_tokens
        self.is_closed = False

    def __repr__(self) -> str:
        return f"AsyncSequence({self.seq_id!r}, cached={self.num_cached_tokens})"

    async def append(
        self, token_ids: codec.TokenIds, k: Any, v: Any, *, timeout_s: float | None = None
    ) -> int:
        return await self.client.data.append(self.seq_id, token_ids, k, v, timeout_s)

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
        res = await self.client.data.attend(
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
        return await self.client.data.attend_prefill(
            self.seq_id, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
        )

    async def fork(self, child_id: str, *, timeout_s: float | None = None) -> AsyncSequence:
        await self.client.control.fork(self.seq_id, child_id, timeout_s)
        return AsyncSequence(self.client, child_id)

    async def read_kv(
        self, start: int = 0, end: int | None = None, *, timeout_s: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await self.client.data.read_kv(self.seq_id, start, end, timeout_s)

    async def swap_out(self, *, timeout_s: float | None = None) -> int:
        return await self.client.control.swap_out(self.seq_id, timeout_s)

    async def swap_in(self, *, timeout_s: float | None = None) -> int:
        return await self.client.control.swap_in(self.seq_id, timeout_s)

    async def set_budget(
        self,
        max_tokens: int | None,
        sink_blocks: int = 1,
        recent_blocks: int = 4,
        *,
        timeout_s: float | None = None,
    ) -> None:
        await self.client.control.set_budget(self.seq_id, max_tokens, sink_blocks, recent_blocks, timeout_s)

    async def close(self, *, timeout_s: float | None = None) -> None:
        if not self.is_closed:
            await self.client.control.free(self.seq_id, timeout_s)
            self.is_closed = True

    async def __aenter__(self) -> AsyncSequence:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


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
        res = await client.control.open(seq_id, token_ids, max_cached, timeout_s)
        return AsyncSequence(client, seq_id, res.num_cached_tokens, res.num_host_hit_tokens)

    def __await__(self) -> Generator[Any, None, AsyncSequence]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncSequence:
        self._seq = await self._open()
        return self._seq

    async def __aexit__(self, *exc: object) -> None:
        if self._seq is not None:
            await self._seq.close()


class AsyncCacheClient:
    """asyncio client of one cache node. Create it inside the running event loop."""

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config if config is not None else ClientConfig()
        self._channel = channels.acquire_aio(address, self.config)
        stub = pb_grpc.CacheNodeStub(self._channel)
        self.control = AsyncNodeControl(stub, self.config)
        self.data = AsyncNodeData(stub, self.config)
        self._is_closed = False

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        *,
        max_cached_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> _Opening:
        return _Opening(self, seq_id, token_ids, max_cached_tokens, timeout_s)

    def sequence(self, seq_id: str) -> AsyncSequence:
        return AsyncSequence(self, seq_id)

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
        ids = [s.seq_id if isinstance(s, AsyncSequence) else s for s in seqs]
        return await self.data.attend(
            ids, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
        )

    async def lookup(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self.control.lookup(token_ids, timeout_s)

    async def pin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self.control.pin(token_ids, timeout_s)

    async def unpin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self.control.unpin(token_ids, timeout_s)

    async def stats(self, *, timeout_s: float | None = None) -> NodeStats:
        return await self.control.stats(timeout_s)

    async def check_integrity(self, *, timeout_s: float | None = None) -> None:
        await self.control.check_integrity(timeout_s)

    async def ping(self, *, timeout_s: float | None = None) -> None:
        await self.control.ping(timeout_s)

    async def close(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            await channels.release_aio(self.address, self.config)

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
