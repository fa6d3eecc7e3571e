"""AsyncCacheClient: the asyncio face of CacheClient, same surface.

    async with AsyncCacheClient(coordinator="coord:50050", token="...") as client:
        async with client.open("req-1", prompt_ids) as seq:
            await seq.append(rest_ids, k, v)
            out = await seq.attend(layer, q, k_new, v_new, token_id)

One implementation: every call is CacheClient's, run on the client's worker
threads (the data calls block on sockets or gRPC either way), so both clients
route, validate and fail alike. `client.open(...)` is both awaitable
(`seq = await client.open(...)`) and an async context manager that closes the
sequence on exit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Generator
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from ..protos.attention import LayerAttention
from ..protos.errors import NotFound, OpenFailed, SequenceLost
from ..protos.spec import ModelSpec
from . import codec
from .config import ClientConfig
from .sync import CacheClient, NodeHandle, Sequence
from .types import AttentionResult, ClusterStats, ExtentRoute, MissExplanation, NodeStats, Route

T = TypeVar("T")
MAX_THREADS = 32  # concurrent calls in flight per client (the default executor has cpu + 4)


class _Face:
    """Any object's methods as coroutines run on the client's threads (a node's
    `data` and `control` in direct mode)."""

    def __init__(self, target: Any, run: Callable[..., Any]) -> None:
        self._target, self._run = target, run

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        async def call(*args: Any, **kw: Any) -> Any:
            return await self._run(attr, *args, **kw)

        return call


class AsyncSequence:
    """The asyncio face of a Sequence."""

    def __init__(self, client: AsyncCacheClient, seq: Sequence) -> None:
        self.client, self.sync = client, seq

    @property
    def seq_id(self) -> str:
        return self.sync.seq_id

    @property
    def route(self) -> Route:
        return self.sync.route

    @property
    def extents(self) -> list[ExtentRoute]:
        return self.sync.extents

    @property
    def num_cached_tokens(self) -> int:
        return self.sync.num_cached_tokens

    @property
    def num_host_hit_tokens(self) -> int:
        return self.sync.num_host_hit_tokens

    @property
    def miss(self) -> MissExplanation | None:
        return self.sync.miss

    @property
    def is_closed(self) -> bool:
        return self.sync.is_closed

    def __repr__(self) -> str:
        return "Async" + repr(self.sync)

    async def append(
        self, token_ids: codec.TokenIds, k: Any, v: Any, *, timeout_s: float | None = None
    ) -> int:
        return await self.client._run(self.sync.append, token_ids, k, v, timeout_s=timeout_s)

    async def attend(self, layer: int, q: Any, *args: Any, **kw: Any) -> AttentionResult:
        return await self.client._run(self.sync.attend, layer, q, *args, **kw)

    async def attend_prefill(self, layer: int, q: Any, *args: Any, **kw: Any) -> AttentionResult:
        return await self.client._run(self.sync.attend_prefill, layer, q, *args, **kw)

    async def fork(self, child_id: str, *, timeout_s: float | None = None) -> AsyncSequence:
        child = await self.client._run(self.sync.fork, child_id, timeout_s=timeout_s)
        return AsyncSequence(self.client, child)

    async def read_kv(
        self,
        start: int = 0,
        end: int | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await self.client._run(self.sync.read_kv, start, end, out=out, timeout_s=timeout_s)

    async def swap_out(self, *, timeout_s: float | None = None) -> int:
        return await self.client._run(self.sync.swap_out, timeout_s=timeout_s)

    async def swap_in(self, *, timeout_s: float | None = None) -> int:
        return await self.client._run(self.sync.swap_in, timeout_s=timeout_s)

    async def set_budget(self, max_tokens: int | None, *args: Any, **kw: Any) -> None:
        await self.client._run(self.sync.set_budget, max_tokens, *args, **kw)

    async def close(self, *, keep_prefix: int | None = None, timeout_s: float | None = None) -> None:
        """See Sequence.close."""
        await self.client._run(self.sync.close, keep_prefix=keep_prefix, timeout_s=timeout_s)

    async def __aenter__(self) -> AsyncSequence:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            await self.close()
        except (OpenFailed, NotFound, SequenceLost):
            if exc_type is None:  # else the body's error (e.g. the OpenFailed itself) says it
                raise


class _Opening:
    """`await client.open(...)` or `async with client.open(...) as seq`."""

    def __init__(self, client: AsyncCacheClient, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        self._client, self._args, self._kw = client, args, kw
        self._seq: AsyncSequence | None = None

    async def _open(self) -> AsyncSequence:
        seq = await self._client._run(self._client.sync.open, *self._args, **self._kw)
        return AsyncSequence(self._client, seq)

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
    see CacheClient."""

    def __init__(
        self,
        address: str | None = None,
        config: ClientConfig | None = None,
        *,
        coordinator: str | None = None,
        token: str | None = None,
        spec: ModelSpec | None = None,
    ) -> None:
        self.sync = CacheClient(address, config, coordinator=coordinator, token=token, spec=spec)
        self.config, self.address = self.sync.config, self.sync.address
        self._threads = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="pagedkv-aio")
        self._faces: dict[str, _Face] = {}

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args, **kw))

    @property
    def is_cluster(self) -> bool:
        return self.sync.is_cluster

    @property
    def control(self) -> _Face:
        """CacheClient.control, its calls awaitable (InvalidArgument for a cluster client)."""
        return self._face("control")

    @property
    def data(self) -> _Face:
        """CacheClient.data, its calls awaitable (InvalidArgument for a cluster client)."""
        return self._face("data")

    def _face(self, what: str) -> _Face:
        face = self._faces.get(what)
        if face is None:
            face = self._faces[what] = _Face(getattr(self.sync, what), self._run)
        return face

    def node(self, address: str) -> NodeHandle:
        """The (cached) sync handle of the node at `address` (its data and control calls)."""
        return self.sync.node(address)

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
    ) -> _Opening:
        kw = {
            "max_cached_tokens": max_cached_tokens,
            "attention": attention,
            "timeout_s": timeout_s,
            "explain_miss": explain_miss,
            "max_extent_tokens": max_extent_tokens,
        }
        return _Opening(self, (seq_id, token_ids), kw)

    async def sequence(self, seq_id: str, *, timeout_s: float | None = None) -> AsyncSequence:
        return AsyncSequence(self, await self._run(self.sync.sequence, seq_id, timeout_s=timeout_s))

    @staticmethod
    def _unwrap(seqs: Seq[AsyncSequence | str]) -> list[Sequence | str]:
        return [s.sync if isinstance(s, AsyncSequence) else s for s in seqs]

    async def attend_batch(
        self, seqs: Seq[AsyncSequence | str], layer: int, q: Any, *args: Any, **kw: Any
    ) -> AttentionResult:
        return await self._run(self.sync.attend_batch, self._unwrap(seqs), layer, q, *args, **kw)

    async def attend_prefill_batch(
        self, seqs: Seq[AsyncSequence | str], layer: int, num_tokens: Seq[int], q: Any, *args: Any, **kw: Any
    ) -> AttentionResult:
        return await self._run(
            self.sync.attend_prefill_batch, self._unwrap(seqs), layer, num_tokens, q, *args, **kw
        )

    async def lookup(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self._run(self.sync.lookup, token_ids, timeout_s=timeout_s)

    async def pin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self._run(self.sync.pin, token_ids, timeout_s=timeout_s)

    async def unpin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return await self._run(self.sync.unpin, token_ids, timeout_s=timeout_s)

    async def stats(self, *, timeout_s: float | None = None) -> NodeStats:
        return await self._run(self.sync.stats, timeout_s=timeout_s)

    async def cluster_stats(self, *, timeout_s: float | None = None) -> ClusterStats:
        return await self._run(self.sync.cluster_stats, timeout_s=timeout_s)

    async def node_stats(self, address: str, *, timeout_s: float | None = None) -> NodeStats:
        return await self._run(self.sync.node_stats, address, timeout_s=timeout_s)

    async def check_integrity(self, *, timeout_s: float | None = None) -> None:
        await self._run(self.sync.check_integrity, timeout_s=timeout_s)

    async def ping(self, *, timeout_s: float | None = None) -> None:
        await self._run(self.sync.ping, timeout_s=timeout_s)

    async def connect(self, *, timeout_s: float | None = None) -> None:
        """CacheClient.connect: every node's gRPC channel and bulk connections opened now."""
        await self._run(self.sync.connect, timeout_s=timeout_s)

    async def close(self) -> None:
        await self._run(self.sync.close)
        self._threads.shutdown(wait=False)

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
