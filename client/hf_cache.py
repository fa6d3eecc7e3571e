"""PagedKVCache: a transformers `Cache` whose K/V live on a pagedkv node.

Each batch row is one node sequence. Pad positions (attention_mask == 0) are never stored: the
node holds only real tokens, so a row's block keys are its real token ids and prefixes are shared
across rows, requests and workers whatever the padding. transformers still sees the padded
layout (get_seq_length() counts pads, as DynamicCache does); `_real` records which padded
positions of each row are stored:

    padded position   0    1    2    3    4    5    6
    row 0 (2 pads)    pad  pad  t0   t1   t2   t3   t4     node sequence: t0..t4
    row 1 (no pads)   u0   u1   u2   u3   u4   u5   u6     node sequence: u0..u6

Two modes:
- "node" (default): update() stores nothing locally; the registered "pagedkv" attention function
  sends this layer's queries and new K/V to the node and gets the output back. K/V never return
  to the worker. One node call per layer per forward for the whole batch (see hf_backend).
- "gather": update() reads each row's K/V back from the node (read_kv), rebuilds the padded
  contiguous tensors and lets transformers' own sdpa attend; new K/V are appended after the
  forward. For comparison: K/V cross the wire every step.

The token ids of a forward (the node keys blocks by them) are taken by a forward pre-hook on the
model itself (hf_generate.install_hooks, once per model); it also marks the cache active for the attention
function (a contextvar: each thread runs its own forward).
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..protos.errors import FailedPrecondition, InvalidArgument, PagedKVError, SpecMismatch
from ..protos.spec import ModelSpec
from .hf_attend import attend_layer
from .hf_backend import KVBackend
from .hf_masks import MaskKind
from .hf_support import ATTENTION_NAME, AttentionPlan, model_shape, plan_attention

Mode = Literal["node", "gather"]
_ACTIVE: contextvars.ContextVar[PagedKVCache | None] = contextvars.ContextVar("pagedkv_cache", default=None)
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def active_cache() -> PagedKVCache | None:
    """The PagedKVCache of the forward running in this thread, if any."""
    return _ACTIVE.get()


@dataclass(frozen=True)
class PrefixHit:
    """What `PagedKVCache.open_prompt` found. `num_cached_tokens[b]`: real tokens row b starts
    with (whole blocks); `start`: the padded position the model resumes at (the same for all
    rows); the model is fed `input_ids[:, start:]`."""

    num_cached_tokens: list[int]
    num_prompt_tokens: list[int]
    start: int


@dataclass
class _Forward:
    """The forward in flight: its token ids and which of its positions are real, per row."""

    token_ids: torch.Tensor  # [B, T] int64, CPU
    is_real: torch.Tensor  # [B, T] bool, CPU: not a pad
    to_store: torch.Tensor  # [B, T] bool: real and not yet on the node (see open_prompt)
    rows: list[torch.Tensor]  # per row, the indices of its to_store positions among the T
    picks: list[slice | torch.Tensor]  # rows[b] as a slice when contiguous (no gather to pick them)
    is_full: bool  # every position of every row is stored: the whole [B, T] block goes to the node
    decode_tokens: list[int] | None  # decode (T == 1, is_full): each row's new token id
    past_k: torch.Tensor | None = None  # gather mode: [L, B, Hk, past_len, D]
    past_v: torch.Tensor | None = None
    new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    masks: dict[int, tuple[torch.Tensor, MaskKind | str]] = field(default_factory=dict)  # by id: mask_marker
    num_layers_done: int = 0


class _PagedLayer(CacheLayerMixin):
    """One model layer's view of the cache: sizes come from the owner, data lives on the node."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: PagedKVCache, layer_idx: int) -> None:
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner._update_layer(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner._length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner._length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("PagedKVCache cannot be reset in place; close it and make a new one")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("PagedKVCache cannot drop tokens (node sequences only grow)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise AssertionError("unreachable: PagedKVCache reorders all layers at once")


def check_model_identity(model: torch.nn.Module, spec: ModelSpec) -> None:
    """A node that names its model serves no other: a same-shape model (a base model and its
    fine-tune) would read K/V its own weights never computed."""
    name = str(getattr(cast(Any, model).config, "_name_or_path", "") or "")
    if spec.model and name != spec.model:
        raise SpecMismatch(
            f"the node serves the KV of model {spec.model!r}, this model is {name or 'not named'!r} "
            "(its config's name_or_path); load that model, or start the node with --model-id matching "
            "this one"
        )


class PagedKVCache(Cache):
    """A transformers Cache backed by a pagedkv node (see the module docstring).

    `model` is needed once, to check it (hf_support.plan_attention: in node mode a model the node
    cannot compute exactly is refused here, naming the model class, the layer and the feature)
    and to install the hooks that read each forward's token ids. In node mode every row's
    sequence is opened with the model's attention spec (plan.layers: windows, chunks, soft-cap),
    which the node follows. `max_tokens`: an optional bound on each row (prompt + generated),
    refused before any node call when passed. `reuse_prefix`: generate() opens the prompt first and
    feeds the model only its uncached suffix (False: every prompt position is computed). Use as
    a context manager, or call `close()`: it frees every row's node sequence (their full blocks
    stay cached on the node for later prefix hits). A forward that raised after its first node
    call leaves the rows half written: close the cache.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: KVBackend,
        *,
        mode: Mode = "node",
        seq_prefix: str = "",
        max_tokens: int | None = None,
        reuse_prefix: bool = True,
    ) -> None:
        if mode not in ("node", "gather"):
            raise InvalidArgument(f"mode must be 'node' or 'gather', got {mode!r}")
        spec = backend.spec
        shape = model_shape(cast(Any, model).config)
        want = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        have = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        if want != have:
            raise InvalidArgument(
                f"model needs (layers, kv heads, head dim) = {want}, the node serves {have}"
            )
        model_dtype = next(model.parameters()).dtype
        if _TORCH_DTYPES[spec.dtype] != model_dtype:
            raise InvalidArgument(f"model runs in {model_dtype}, the node serves {spec.dtype}")
        check_model_identity(model, spec)
        if mode == "node":
            self.plan = plan_attention(model, max_tokens)
        else:  # the model's own attention runs over gathered K/V: every feature it has works
            self.plan = AttentionPlan(type(model).__name__, spec.num_layers, max_tokens, ())
        super().__init__(layers=[_PagedLayer(self, i) for i in range(spec.num_layers)])
        from .hf_generate import install_hooks  # hf_generate imports this module

        install_hooks(model)
        self.backend, self.spec, self.mode = backend, spec, mode
        self.max_tokens, self.reuse_prefix = max_tokens, reuse_prefix
        # Every open carries the spec (a backend written before it existed serves plain models).
        self._open_kw = {"attention": self.plan.layers} if self.plan.layers else {}
        self.last_hit: PrefixHit | None = None  # what open_prompt found, if it ran
        self._prefix = seq_prefix or f"hf-{uuid.uuid4().hex[:12]}"
        self._next_id = 0
        self._seq_ids: list[str] = []
        self._real = torch.zeros(0, 0, dtype=torch.bool)  # [B, length]: stored positions
        self._length = 0
        self._stored_until = torch.zeros(0, dtype=torch.long)  # [B]: padded positions below are stored
        self._max_stored_until = 0  # max(_stored_until), kept as an int for the per-forward check
        self._pending: _Forward | None = None
        self._is_closed = False
        self.num_cached_tokens: list[int] = []  # per row, from the node at open
        self.fed_lengths: list[int] = []  # query positions (per row) of each forward so far

    # -- introspection ------------------------------------------------------------

    @property
    def seq_ids(self) -> list[str]:
        """The node sequence behind each batch row (empty until the first forward / open)."""
        return list(self._seq_ids)

    @property
    def num_stored_tokens(self) -> list[int]:
        """Real tokens each row holds on the node."""
        return self._real.sum(1).tolist()

    def _new_seq_id(self) -> str:
        self._next_id += 1
        return f"{self._prefix}-{self._next_id}"

    def _check_open(self) -> None:
        if self._is_closed:
            raise FailedPrecondition("this PagedKVCache is closed")

    # -- opening ------------------------------------------------------------------

    def open_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PrefixHit:
        """Open one node sequence per row with the full prompt, starting from the longest prefix
        the node has cached, so that the model only needs `input_ids[:, start:]`.

        Rows must be left-padded. Each row reuses its whole-block hit; the model input is
        rectangular, so it resumes at the smallest end of a hit (`start`) and a row whose hit
        reaches further has positions fed again that are already stored: those are neither
        appended nor attended for (their outputs, and logits, are zeros / meaningless):

            row 0   | pads | cached ............ | fed + stored           |
            row 1   | cached ....................... | fed, skipped | stored |
                    0    start (smallest hit end)   ^ row 1's hit end     T

        Changes: the node sequences exist; get_seq_length() becomes `start`.
        """
        self._check_open()
        if self._seq_ids:
            raise FailedPrecondition("open_prompt: the cache already holds sequences")
        ids, mask = _ids_and_mask(input_ids, attention_mask)
        pads = (~mask).sum(1).tolist()
        for b, p in enumerate(pads):
            if p and (mask[b, :p].any() or not mask[b, p:].all()):
                raise InvalidArgument(f"open_prompt: row {b} is not left-padded")
        real_ids = [ids[b, p:].tolist() for b, p in enumerate(pads)]
        if any(len(r) == 0 for r in real_ids):
            raise InvalidArgument("open_prompt: a row holds no real token")
        # One Open per row and no Lookup first: the node reuses the longest cached prefix in
        # whole blocks up to the limit and says how much it took. Never the last token: the
        # model must compute at least one position per row.
        seq_ids = [self._new_seq_id() for _ in real_ids]
        cached: list[int] = []
        try:
            for sid, r in zip(seq_ids, real_ids, strict=True):
                cached.append(self.backend.open(sid, r, len(r) - 1, **self._open_kw))
        except PagedKVError:
            for sid in seq_ids[: len(cached)]:
                self.backend.free(sid)
            raise
        start = min(p + c for p, c in zip(pads, cached, strict=True))
        self._seq_ids = seq_ids
        self._real = mask[:, :start].clone()
        self._length = start
        stored_until = [p + c for p, c in zip(pads, cached, strict=True)]
        self._stored_until = torch.tensor(stored_until, dtype=torch.long)
        self._max_stored_until = max(stored_until)
        self.num_cached_tokens = cached
        self.last_hit = PrefixHit(cached, [len(r) for r in real_ids], start)
        return self.last_hit

    # -- the forward, driven by the hooks and the attention function ------------------------

    def _begin_forward(self, input_ids: Any, attention_mask: Any) -> None:
        self._check_open()
        if self._pending is not None:
            raise FailedPrecondition(
                "a previous forward failed midway; its rows are half written: close the cache"
            )
        if input_ids is None:
            raise InvalidArgument("PagedKVCache needs input_ids (the node keys blocks by token ids)")
        ids = input_ids.detach().to("cpu", torch.long)
        if ids.ndim != 2:
            raise InvalidArgument(f"input_ids must be [batch, length], got {tuple(ids.shape)}")
        num_rows, num_new = ids.shape
        if attention_mask is None:
            is_real = torch.ones(num_rows, num_new, dtype=torch.bool)
        else:
            if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (num_rows, self._length + num_new):
                raise InvalidArgument(
                    f"attention_mask must be 2-D [{num_rows}, {self._length + num_new}] "
                    f"(cached + new positions), got {tuple(attention_mask.shape)}"
                )
            full = attention_mask.detach().to("cpu").bool()
            if self._seq_ids and not torch.equal(full[:, : self._length], self._real):
                raise InvalidArgument("attention_mask disagrees with the cached rows' padding")
            is_real = full[:, self._length :]
        if self._seq_ids and num_rows != len(self._seq_ids):
            raise InvalidArgument(f"batch of {num_rows} rows, the cache holds {len(self._seq_ids)}")
        if self.max_tokens is not None:
            self._check_bound(is_real)
        if self.plan.masks:
            self._check_left_padded(is_real)
        if not self._seq_ids:
            self._open_fresh(ids, is_real)
        if self._max_stored_until <= self._length:  # every row's prompt hit is behind us
            to_store = is_real
        else:
            positions = torch.arange(self._length, self._length + num_new)
            to_store = is_real & (positions[None, :] >= self._stored_until[:, None])
        # Per-forward bookkeeping is computed once here, not per layer; the usual forward (no
        # pads among the new positions, no hit reaching past `start`) needs no per-row indices.
        if bool(to_store.all()):
            every = torch.arange(num_new)
            rows, picks = [every] * num_rows, [slice(0, num_new)] * num_rows
            decode_tokens = ids[:, 0].tolist() if num_new == 1 else None
            fwd = _Forward(ids, is_real, to_store, rows, list(picks), True, decode_tokens)
        else:
            rows = [row.nonzero().flatten() for row in to_store]
            fwd = _Forward(ids, is_real, to_store, rows, [_as_slice(idx) for idx in rows], False, None)
        if self.mode == "gather":
            fwd.past_k, fwd.past_v = self._gather_past()
        self._pending = fwd

    def _check_bound(self, is_real: torch.Tensor) -> None:
        """Refuse a forward that would take a row past `max_tokens` (before any node call)."""
        stored = self._real.sum(1) if self._seq_ids else torch.zeros(is_real.shape[0], dtype=torch.long)
        lengths = stored + is_real.sum(1)
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > cast(int, self.max_tokens):
            row = int(lengths.argmax())
            raise InvalidArgument(
                f"row {row} would hold {longest} tokens, beyond max_tokens={self.max_tokens}"
            )

    def _check_left_padded(self, is_real: torch.Tensor) -> None:
        """Windows and chunks count a row's positions from its first real token, pads included
        after it in transformers, never stored on the node: refuse a pad after a real token."""
        num_rows = is_real.shape[0]
        started = self._real[:, -1:] if self._length else torch.zeros(num_rows, 1, dtype=torch.bool)
        before = torch.cat([started, is_real[:, :-1]], 1).long().cummax(1).values.bool()
        late = (before & ~is_real).any(1)
        if bool(late.any()):
            row = int(late.nonzero()[0])
            raise InvalidArgument(
                f"row {row} has a pad after a real token: {self.plan.model_name}'s sliding windows or chunks "
                "need left padding (their positions count from a row's first token)"
            )

    def mask_marker(self, kind: MaskKind | str) -> torch.Tensor:
        """A stand-in for a mask the node applies itself (a window or chunks: `kind`) or cannot
        apply (why, a str): an empty tensor each layer receiving it checks against its spec,
        refusing the mismatch or the reason (hf_support.check_call)."""
        marker = torch.zeros(0, dtype=torch.bool)
        self._forward().masks[id(marker)] = (marker, kind)
        return marker

    @property
    def masks(self) -> dict[int, tuple[torch.Tensor, MaskKind | str]]:
        return self._pending.masks if self._pending is not None else {}

    def abandon_forward(self) -> None:
        """A forward refused before its first node call: forget it, nothing was written (its rows
        stay open and usable). After a node call the rows are half written and stay marked."""
        if self._pending is not None and self._pending.num_layers_done == 0:
            self._pending = None
        _ACTIVE.set(None)

    def _open_fresh(self, ids: torch.Tensor, is_real: torch.Tensor) -> None:
        """First forward without open_prompt: plain sequences, no prefix reuse (the model is
        about to compute every position anyway)."""
        seq_ids = [self._new_seq_id() for _ in range(ids.shape[0])]
        opened: list[str] = []
        try:
            for sid, row, real in zip(seq_ids, ids, is_real, strict=True):
                self.backend.open(sid, row[real].tolist(), 0, **self._open_kw)
                opened.append(sid)
        except PagedKVError:
            for sid in opened:
                self.backend.free(sid)
            raise
        self._seq_ids = seq_ids
        self._real = torch.zeros(ids.shape[0], 0, dtype=torch.bool)
        self._stored_until = torch.zeros(ids.shape[0], dtype=torch.long)
        self._max_stored_until = 0
        self.num_cached_tokens = [0] * len(seq_ids)

    def _end_forward(self) -> None:
        fwd = self._pending
        self._pending = None
        if fwd is None:
            return
        if fwd.num_layers_done != self.spec.num_layers:
            cause = (
                f"the model's attention does not call the {ATTENTION_NAME!r} attention function: build it "
                f"with attn_implementation={ATTENTION_NAME!r} (pagedkv.client.transformers.load_model does)"
                if fwd.num_layers_done == 0 and self.mode == "node"
                else "some layers' attention bypassed the cache"
            )
            done = f"{fwd.num_layers_done} of {self.spec.num_layers}"
            raise FailedPrecondition(f"the forward ran {done} layers through the cache: {cause}")
        if self.mode == "gather":
            self._append_new(fwd)
        self._real = torch.cat([self._real, fwd.is_real], dim=1)
        self._length += fwd.token_ids.shape[1]
        self.fed_lengths.append(fwd.token_ids.shape[1])

    def _forward(self) -> _Forward:
        if self._pending is None:
            raise FailedPrecondition(
                "PagedKVCache used outside a hooked forward: build the cache with the model it serves"
            )
        return self._pending

    def _update_layer(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fwd = self._forward()
        if self.mode == "node":
            return key, value  # the attention function sends them to the node
        fwd.new_kv[layer] = (key, value)
        fwd.num_layers_done += 1
        assert fwd.past_k is not None and fwd.past_v is not None
        past_k = fwd.past_k[layer].to(key.device)
        past_v = fwd.past_v[layer].to(value.device)
        return torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        q_scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Node mode: append this layer's new K/V and attend on the node (hf_attend.attend_layer).
        query [B, Hq, T, D], key/value [B, Hk, T, D] -> out [B, T, Hq, D] (zeros at pad positions)."""
        fwd = self._forward()
        out = attend_layer(self.backend, self._seq_ids, fwd, layer, query, key, value, q_scale, sinks)
        fwd.num_layers_done += 1
        return out

    # -- gathered-KV mode ------------------------------------------------------------------

    def _gather_past(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's stored K/V, scattered back into the padded layout: [L, B, Hk, length, D]."""
        s = self.spec
        shape = (s.num_layers, len(self._seq_ids), s.num_kv_heads, self._length, s.head_dim)
        past_k = torch.zeros(shape, dtype=_TORCH_DTYPES[s.dtype])
        past_v = torch.zeros_like(past_k)
        if self._length == 0:
            return past_k, past_v
        for b, sid in enumerate(self._seq_ids):
            idx = self._real[b].nonzero().flatten()
            if idx.numel() == 0:
                continue
            k, v = self.backend.read_kv(sid)  # [L, n, Hk, D]
            past_k[:, b][:, :, idx] = k.permute(0, 2, 1, 3)
            past_v[:, b][:, :, idx] = v.permute(0, 2, 1, 3)
        return past_k, past_v

    def _append_new(self, fwd: _Forward) -> None:
        keys = torch.stack([fwd.new_kv[layer][0].detach().cpu() for layer in range(self.spec.num_layers)])
        values = torch.stack([fwd.new_kv[layer][1].detach().cpu() for layer in range(self.spec.num_layers)])
        for b, idx in enumerate(fwd.rows):  # keys [L, B, Hk, T, D] -> row b [L, n_b, Hk, D]
            if idx.numel():
                k = keys[:, b][:, :, idx].transpose(1, 2).contiguous()
                v = values[:, b][:, :, idx].transpose(1, 2).contiguous()
                self.backend.append(self._seq_ids[b], fwd.token_ids[b, idx].tolist(), k, v)

    # -- rows: beam search and friends -------------------------------------------------

    def _remap(self, parents: Sequence[int]) -> None:
        """New row i continues old row parents[i]: a parent's first child takes over its sequence,
        later children fork it (sharing every block; copy-on-write does the rest), parents no
        child chose are freed. Forks happen before frees, so every fork finds its parent."""
        self._check_open()
        old = self._seq_ids
        if not old or list(parents) == list(range(len(old))):
            return
        if any(not 0 <= p < len(old) for p in parents):
            raise InvalidArgument(f"row indices {list(parents)} out of range for {len(old)} rows")
        new: list[str] = []
        taken: set[int] = set()
        for p in parents:
            if p in taken:
                child = self._new_seq_id()
                self.backend.fork(old[p], child)
                new.append(child)
            else:
                taken.add(p)
                new.append(old[p])
        for p, sid in enumerate(old):
            if p not in taken:
                self.backend.free(sid)
        index = torch.tensor(list(parents), dtype=torch.long)
        self._seq_ids = new
        self._real = self._real.index_select(0, index)
        self._stored_until = self._stored_until.index_select(0, index)
        self._max_stored_until = int(self._stored_until.max()) if len(new) else 0
        self.num_cached_tokens = [self.num_cached_tokens[p] for p in parents]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i now continues beam beam_idx[i]."""
        self._remap(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap([b for b in range(len(self._seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap(indices.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("PagedKVCache cannot drop tokens (node sequences only grow)")

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Free every row's node sequence. Idempotent; the first failure is raised after trying all."""
        if self._is_closed:
            return
        self._is_closed = True
        first: PagedKVError | None = None
        for sid in self._seq_ids:
            try:
                self.backend.free(sid)
            except PagedKVError as exc:
                first = first or exc
        self._seq_ids = []
        if first is not None:
            raise first

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_slice(idx: torch.Tensor) -> slice | torch.Tensor:
    """Sorted distinct indices as a slice when they are consecutive (the usual case: a row's new
    positions are all real, or its left pads end before them), else unchanged."""
    n = idx.numel()
    if n == 0:
        return idx
    first, last = int(idx[0]), int(idx[-1])
    return slice(first, last + 1) if last - first + 1 == n else idx


def _ids_and_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = input_ids.detach().to("cpu", torch.long)
    if ids.ndim != 2:
        raise InvalidArgument(f"input_ids must be [batch, length], got {tuple(ids.shape)}")
    if attention_mask is None:
        return ids, torch.ones(ids.shape, dtype=torch.bool)
    mask = attention_mask.detach().to("cpu").bool()
    if mask.shape != ids.shape:
        raise InvalidArgument(
            f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}"
        )
    return ids, mask


# -- hooks (installed by hf_generate.install_hooks) -------------------------------------------


def pre_forward_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PagedKVCache):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache._begin_forward(input_ids, kwargs.get("attention_mask"))
        _ACTIVE.set(cache)
    else:
        _ACTIVE.set(None)


def post_forward_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    cache = _ACTIVE.get()
    _ACTIVE.set(None)
    if cache is not None:
        cache._end_forward()
