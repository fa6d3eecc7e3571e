"""What the engine accepts from a caller: the node's one check of wire input.

Every engine method calls these before it changes anything, so a bad request raises
InvalidArgument naming what was wrong and leaves the engine as it was. The attention
functions behind the engine trust what passed here (attention/decode.py: decode_trusted).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..protos.errors import InvalidArgument
from ..protos.spec import ModelSpec

MAX_TOKEN_ID = 2**63 - 1


def token_list(token_ids: Any, what: str) -> list[int]:
    """Token ids as a list of Python ints, or InvalidArgument naming the problem."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy(force=True)
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim == 1 and not token_ids.size:
            return []  # np.asarray of an empty field is float64
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise InvalidArgument(f"{what}: token ids must be a 1-D integer array, got {token_ids.dtype}")
        # An integer array needs only a range check, in C: the per-item loop below costs
        # ~40 us for a 1,152-token prompt (a node Open's ids come as an array of the field).
        if token_ids.min() >= 0 and int(token_ids.max()) <= MAX_TOKEN_ID:
            return token_ids.tolist()  # type: ignore[no-any-return]
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, list | tuple):
        raise InvalidArgument(f"{what}: token ids must be a list of ints, got {type(token_ids).__name__}")
    for t in token_ids:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise InvalidArgument(f"{what}: token id {t!r} is not an int in [0, 2**63)")
    return list(token_ids)


def seq_id_of(seq_id: Any) -> str:
    if not isinstance(seq_id, str) or not seq_id:
        raise InvalidArgument(f"sequence id must be a non-empty string, got {seq_id!r}")
    return seq_id


def batch_ids(seq_ids: Any, call: str, kind: str) -> list[str]:
    """A batch's sequence ids: at least one, each named once."""
    ids = [seq_id_of(s) for s in seq_ids]
    if not ids:
        raise InvalidArgument(f"{call} needs at least one sequence")
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"a {kind} batch lists a sequence more than once")
    return ids


class RequestChecks:
    """The checks that need the node's shape: tensors of its dtype and shape, layers in range,
    a step's token ids. Each returns the value ready for the engine (tensors on its device)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec, self.dtype, self.device = spec, dtype, device

    def _node_tensor(self, name: str, t: Any) -> torch.Tensor:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(t)
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != self.dtype:
            raise InvalidArgument(
                f"{name} has dtype {str(t.dtype).removeprefix('torch.')}, this node serves {self.spec.dtype}"
            )
        return t

    def tensor(self, name: str, t: Any, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._node_tensor(name, t)
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(self.device)

    def kv_slabs(self, slabs: Any, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V slabs (k_i, v_i), each [num_layers, t_i, kv_heads, head_dim], holding num_tokens
        tokens in all."""
        s = self.spec
        checked = []
        total = 0
        for i, (k, v) in enumerate(slabs):
            t = k.shape[1] if isinstance(k, torch.Tensor | np.ndarray) and k.ndim == 4 else -1
            shape = (s.num_layers, t, s.num_kv_heads, s.head_dim)
            checked.append((self.tensor(f"k slab {i}", k, shape), self.tensor(f"v slab {i}", v, shape)))
            total += t
        if total != num_tokens:
            raise InvalidArgument(f"{total} tokens of K/V for {num_tokens} token ids")
        return checked

    def query(self, name: str, q: Any, shape: tuple[int | None, ...]) -> torch.Tensor:
        """q of `shape` (None: any size) whose query heads (dim 1) are a multiple of the KV heads."""
        q = self._node_tensor(name, q)
        ok = q.ndim == len(shape) and all(
            want is None or got == want for got, want in zip(q.shape, shape, strict=True)
        )
        hq = q.shape[1] if q.ndim == 3 else 0
        if not ok or hq == 0 or hq % self.spec.num_kv_heads:
            raise InvalidArgument(
                f"{name} has shape {tuple(q.shape)}, "
                f"expected {tuple('*' if d is None else d for d in shape)} "
                f"with query heads a multiple of {self.spec.num_kv_heads} kv heads"
            )
        return q.to(self.device)

    def layer(self, layer: Any) -> int:
        if type(layer) is not int or not 0 <= layer < self.spec.num_layers:
            raise InvalidArgument(f"layer {layer!r} out of range [0, {self.spec.num_layers})")
        return layer

    def step_tokens(self, layer: int, k: Any, v: Any, token_ids: Any, n: int) -> list[int] | None:
        """The token ids a layer-by-layer write takes: n of them at layer 0 with k and v, none
        at later layers or without k and v."""
        if (k is None) != (v is None):
            raise InvalidArgument("k and v must be given together")
        if k is None:
            if token_ids is not None:
                raise InvalidArgument("token_ids given without k and v")
            return None
        if layer == 0:
            if token_ids is None:
                raise InvalidArgument("layer 0 appends new tokens: token_ids are required")
            tokens = token_list(token_ids, "attend")
            if len(tokens) != n:
                raise InvalidArgument(f"{len(tokens)} token ids for {n} new tokens")
            return tokens
        if token_ids is not None:
            raise InvalidArgument(f"token_ids are taken at layer 0 only (got them at layer {layer})")
        return None

    def writers(self, ids: list[str], appends: Any, k: Any) -> list[str]:
        """The sequences of a decode batch that append (k, v and token ids hold their rows):
        every one without `appends`, else those flagged (one flag per sequence, >= 1 set, k given)."""
        if appends is None or (not isinstance(appends, bool | int) and len(appends) == 0):
            return ids
        flags = list(appends)
        if len(flags) != len(ids):
            raise InvalidArgument(f"appends: {len(flags)} flags for {len(ids)} sequences")
        if any(type(a) not in (bool, int) or a not in (0, 1) for a in flags):
            raise InvalidArgument(f"appends: flags must be 0/1 (one per sequence), got {flags!r}")
        if k is None or not any(flags):
            raise InvalidArgument("appends: flags need k and v, and at least one row that appends")
        return [sid for sid, a in zip(ids, flags, strict=True) if a]

    def step_kv(self, k: Any, v: Any, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step's new K and V, each [n, kv_heads, head_dim] (or both None)."""
        if k is None:
            return None, None
        shape = (n, self.spec.num_kv_heads, self.spec.head_dim)
        return self.tensor("k", k, shape), self.tensor("v", v, shape)
