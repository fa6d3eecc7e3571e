"""Request builders and response decoders shared by the sync and asyncio clients.

Pure functions: python/numpy/torch values <-> protobuf messages. Tensors go
through pagedkv.protos.tensors, the one wire encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from ..protos import pagedkv_pb2 as pb
from ..protos import prompt, tensors
from ..protos.errors import InvalidArgument
from ..protos.spec import ModelSpec
from .types import AttentionResult, NodeStats, OpenResult

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
M = TypeVar("M")


def token_list(token_ids: TokenIds | None) -> list[int]:
    """Token ids as a fresh list of Python ints (what a request field takes).

    An integer array's tolist() is already that, much faster than int() per id."""
    if token_ids is None:
        return []
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy(force=True)
    if isinstance(token_ids, np.ndarray):
        flat = token_ids.reshape(-1).tolist()
        return flat if token_ids.dtype.kind in "iu" else list(map(int, flat))
    return list(map(int, token_ids))


def with_token_ids(message: Callable[..., M], token_ids: TokenIds | None, **fields: Any) -> M:
    """message(token_ids=..., **fields) for an open or a lookup. A list goes in as it is:
    the message checks every id (an int in the int64 range) and copies them in C,
    several times faster than token_list first. A bad id (a float,
    a bool, a string, out of range) raises InvalidArgument, as the node does."""
    ids = token_ids if type(token_ids) is list else token_list(token_ids)
    try:
        return message(token_ids=ids, **fields)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"token ids must be ints in the int64 range: {exc}") from None


def packed_prompt(token_ids: TokenIds) -> bytes | None:
    """The ids as packed int32s (a message's packed_token_ids), or None when one does not
    fit or is not an int: then with_token_ids sends them, and says which is wrong."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy(force=True).reshape(-1)
    elif isinstance(token_ids, np.ndarray):
        token_ids = token_ids.reshape(-1)
    return prompt.pack(token_ids)


def _set_tensor(msg: Any, field: str, t: Any) -> None:
    if t is not None:
        getattr(msg, field).CopyFrom(tensors.encode(t, field))


def attend_request(
    seq_ids: Sequence[str],
    layer: int,
    q: Any,
    k: Any,
    v: Any,
    token_ids: TokenIds | None,
    mass: bool,
    appends: Sequence[int] = (),
) -> pb.AttendRequest:
    req = pb.AttendRequest(
        seq_ids=list(seq_ids),
        layer=layer,
        token_ids=token_list(token_ids),
        return_block_mass=mass,
        appends=[bool(a) for a in appends],
    )
    _set_tensor(req, "q", q)
    _set_tensor(req, "k", k)
    _set_tensor(req, "v", v)
    return req


def prefill_request(
    seq_id: str,
    layer: int,
    q: Any,
    k: Any,
    v: Any,
    token_ids: TokenIds | None,
    mass: bool,
    query_position: int | None = None,
) -> pb.AttendPrefillRequest:
    req = pb.AttendPrefillRequest(
        seq_id=seq_id, layer=layer, token_ids=token_list(token_ids), return_block_mass=mass
    )
    if query_position is not None:
        req.query_position = query_position
    _set_tensor(req, "q", q)
    _set_tensor(req, "k", k)
    _set_tensor(req, "v", v)
    return req


def attention_result(resp: pb.AttendResponse) -> AttentionResult:
    mass = tensors.decode(resp.block_mass, "block_mass") if resp.HasField("block_mass") else None
    return AttentionResult(tensors.decode(resp.out, "out"), tensors.decode(resp.lse, "lse"), mass)


def append_chunks(
    seq_id: str, token_ids: TokenIds, k: torch.Tensor, v: torch.Tensor, chunk_bytes: int
) -> Iterator[pb.AppendChunk]:
    """The Append stream: the header with the first slab, then slabs of whole tokens
    (~chunk_bytes each) of stack(k, v)[:, :, a:b] -- never one payload-sized buffer.
    k, v: as transport/calls.py append_call checked them."""
    header = pb.AppendHeader(
        seq_id=seq_id,
        token_ids=token_list(token_ids),
        kv=pb.TensorHeader(dtype=tensors.DTYPE_NAMES[k.dtype], shape=[2, *k.shape]),
    )
    for i, (num_tokens, data) in enumerate(tensors.kv_slabs(k, v, chunk_bytes)):
        chunk = pb.AppendChunk(data=data, num_tokens=num_tokens)
        if i == 0:
            chunk.header.CopyFrom(header)
        yield chunk


KVOut = tuple[torch.Tensor, torch.Tensor]  # read_kv's caller-owned destination (k, v)


def check_kv_out(out: Any) -> KVOut | None:
    """read_kv's `out` before anything is sent: None, or two contiguous CPU tensors
    of one 4-d shape and dtype that the wire carries. InvalidArgument names what is wrong."""
    if out is None:
        return None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InvalidArgument(f"out must be a (k, v) pair of tensors, got {type(out).__name__}")
    k, v = out
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"out {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidArgument(
                f"out {name} must be a contiguous CPU tensor, got {t.device} strides {tuple(t.stride())}"
            )
    if k.shape != v.shape or k.dtype != v.dtype or k.dim() != 4:
        raise InvalidArgument(
            f"out k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must be one "
            "[num_layers, n, kv_heads, head_dim] shape and dtype"
        )
    if k.dtype not in tensors.DTYPE_NAMES:
        raise InvalidArgument(f"out has unsupported dtype {k.dtype}")
    nbytes = k.numel() * k.element_size()
    if nbytes and abs(k.data_ptr() - v.data_ptr()) < nbytes:  # one [2, ...] buffer's halves are fine
        raise InvalidArgument("out k and v overlap in memory")
    return k, v


def kv_destination(out: KVOut | None, shape: tuple[int, ...], dtype: torch.dtype) -> KVOut:
    """Where a read of this shape and dtype lands: `out` (checked by check_kv_out) when it
    matches exactly, else InvalidArgument naming both; fresh tensors without one."""
    if out is None:
        return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    if tuple(out[0].shape) != tuple(shape) or out[0].dtype != dtype:
        raise InvalidArgument(
            f"out is {tuple(out[0].shape)} {out[0].dtype}; the range read is {tuple(shape)} {dtype} "
            "([num_layers, n, kv_heads, head_dim])"
        )
    return out


class KVReader:
    """Reassembles a ReadKV stream into (k, v), each [num_layers, n, kv_heads, head_dim],
    allocated once from the header (or the caller's `out`, checked by check_kv_out)
    and filled slab by slab."""

    def __init__(self, out: KVOut | None = None) -> None:
        self._reader: tensors.SlabReader | None = None
        self._out = out
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def add(self, chunk: pb.KVChunk) -> None:
        if self._reader is None:
            if not chunk.HasField("header"):
                raise InvalidArgument("ReadKV: the first chunk carries no header")
            h = chunk.header
            self._reader = tensors.SlabReader(h.dtype, h.shape, "kv")
            _, layers, n, heads, dim = (int(d) for d in h.shape)
            dtype = tensors.TORCH_DTYPES[h.dtype]
            self._k, self._v = kv_destination(self._out, (layers, n, heads, dim), dtype)
        at = self._reader.received
        slab = self._reader.add(chunk.num_tokens, chunk.data)
        assert self._k is not None and self._v is not None
        self._k[:, at : at + chunk.num_tokens].copy_(slab[0])
        self._v[:, at : at + chunk.num_tokens].copy_(slab[1])

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._reader is None or self._k is None or self._v is None:
            raise InvalidArgument("ReadKV: empty stream")
        self._reader.finish()
        return self._k, self._v


def read_kv_request(seq_id: str, start: int, end: int | None, chunk_bytes: int) -> pb.ReadKVRequest:
    req = pb.ReadKVRequest(seq_id=seq_id, start=start, chunk_bytes=chunk_bytes)
    if end is not None:
        req.end = end
    return req


def kv_from_chunks(chunks: Iterable[pb.KVChunk], out: KVOut | None = None) -> KVOut:
    reader = KVReader(out)
    for c in chunks:
        reader.add(c)
    return reader.result()


def open_request(
    seq_id: str,
    token_ids: TokenIds,
    salt: bytes,
    max_cached_tokens: int | None,
    attention: Sequence[pb.LayerAttention] = (),
) -> pb.OpenRequest:
    req = with_token_ids(pb.OpenRequest, token_ids, seq_id=seq_id, tenant_salt=salt)
    if max_cached_tokens is not None:
        req.max_cached_tokens = max_cached_tokens
    if attention:
        req.attention.extend(attention)
    return req


def open_result(resp: pb.OpenResponse) -> OpenResult:
    return OpenResult(resp.num_cached_tokens, resp.num_host_hit_tokens)


def budget_request(
    seq_id: str, max_tokens: int | None, sink_blocks: int, recent_blocks: int
) -> pb.SetBudgetRequest:
    req = pb.SetBudgetRequest(seq_id=seq_id, sink_blocks=sink_blocks, recent_blocks=recent_blocks)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    return req


def kv_bytes(k: Any, v: Any) -> int:
    """Bytes of a K/V pair as sent (0 when they are not tensors: the rpc path says why)."""
    try:
        return int(k.nbytes) + int(v.nbytes)
    except (AttributeError, TypeError):
        return 0


def bulk_info(resp: pb.StatsResponse) -> tuple[int, int]:
    """(bulk port, 0 when off; bytes per token) from a node's Stats reply."""
    s = resp.spec
    spec = ModelSpec(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.block_size, s.model)
    return resp.bulk_port, spec.bytes_per_token


def stats_result(resp: pb.StatsResponse) -> NodeStats:
    s = resp.spec
    spec = ModelSpec(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.block_size, s.model)
    return NodeStats(dict(resp.counters), spec, resp.device, resp.policy)


def prefill_batch_request(
    seq_ids: Sequence[str],
    layer: int,
    num_tokens: Sequence[int],
    q: Any,
    k: Any,
    v: Any,
    token_ids: TokenIds | None,
) -> pb.AttendPrefillBatchRequest:
    """AttendPrefillBatch: sequence i owns the next num_tokens[i] rows of q, k, v, token_ids."""
    req = pb.AttendPrefillBatchRequest(
        seq_ids=list(seq_ids),
        layer=layer,
        num_tokens=[int(n) for n in num_tokens],
        token_ids=token_list(token_ids),
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        _set_tensor(req, name, t)
    return req
