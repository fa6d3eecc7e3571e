"""CacheEngine: one node's KV memory -- the block pool tensors, the bookkeeping
(KVCacheManager) and paged attention -- behind one validated, thread-safe API.

Memory layout (one tensor per tier, preallocated at start):

    kv[layer, 0 or 1 (K or V), block, kv_head, offset_in_block, head_dim]

A block id names the same slot in every layer, so one block-table entry serves
the whole model, and copying a block (copy-on-write, swap, host tier) is one
index_copy over dim 2.

The decode data path is append-and-attend: `attend_decode(..., layer=0,
token_ids=...)` reserves the new tokens' slots and writes layer 0's K/V; the
calls for layers 1..L-1 write into the same slots. So a decode step is
num_layers calls for a whole batch, with no other round trip.

Thread safety: every public method holds one lock for its whole duration (the
bookkeeping is not reentrant-safe and attention must not read blocks another
thread is reallocating); torch ops inside parallelise across cores themselves.
With EngineConfig.compute_thread (`pagedkv node --compute-thread on`) the pool is made and
every public method runs on one thread of the engine's own, whichever thread
calls it (compute_thread.py says why: one torch thread pool per process).
Every method validates its input before changing anything: a bad request raises
a domain error (pagedkv.protos.errors) and leaves the engine exactly as it was.
"""

from __future__ import annotations

import functools
import hmac
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, TypeVar

import numpy as np
import torch

from ..protos.attention import LayerAttention
from ..protos.errors import InvalidArgument, PagedKVError, PrefixEvicted, SequenceNotFound
from .attention import AttentionOutput
from .attention.decode import decode_trusted
from .attention.given_mass import block_mass_given
from .attention.prefill import prefill_trusted
from .block_mass import credit_mass, tracks_mass
from .compute_thread import ComputeThread
from .engine_config import TORCH_DTYPES, EngineConfig, default_device
from .engine_input import RequestChecks, batch_ids, seq_id_of, token_list
from .kv_manager import DEVICE, HOST, BlockEvent, Budget, KVCacheManager, OpenResult, Slots
from .layered_writes import LayeredWrites
from .open_waits import OpenWaits
from .pool_io import PoolIO
from .tensor_mover import TensorMover
from .windows import SequenceSpecs

__all__ = ["CacheEngine", "EngineConfig"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _computes(method: F) -> F:
    """A public method that runs on the engine's compute thread when it has one."""

    @functools.wraps(method)
    def on_compute_thread(self: CacheEngine, *args: Any, **kwargs: Any) -> Any:
        worker = self._worker
        if worker is None or worker.is_current():
            return method(self, *args, **kwargs)
        return worker.call(method, self, *args, **kwargs)

    return on_compute_thread  # type: ignore[return-value]


class CacheEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = spec = config.spec
        self.device = torch.device(config.device or default_device())
        self.dtype = TORCH_DTYPES[spec.dtype]
        self._worker = ComputeThread() if config.compute_thread else None
        self._checks = RequestChecks(spec, self.dtype, self.device)
        shape = (spec.num_layers, 2, config.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        host_shape = (*shape[:2], config.num_host_blocks, *shape[3:])
        self.kv, self.host_kv = self.run(
            lambda: (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(host_shape, dtype=self.dtype, pin_memory=self.device.type == "cuda"),
            )
        )
        self._io = PoolIO(self.kv, spec.block_size)
        self.manager = self._new_manager()
        self.specs = SequenceSpecs(spec.num_layers, spec.block_size)  # windows.py: per-sequence attention
        self._lock = threading.RLock()
        self._waits = OpenWaits(self._lock, config.max_tombstones)  # opens a data call may overtake
        self._layered = LayeredWrites(spec.num_layers)  # layer 0's blocks, published after the last
        self.open_grace: Callable[[str, float], float] = lambda _seq_id, grace_s: grace_s  # (gate.py)
        self.missing: Callable[[SequenceNotFound], PagedKVError] = lambda exc: exc  # (gate.py)

    def run(self, fn: Callable[[], T]) -> T:
        """fn() on the engine's compute thread (inline when it has none): for a
        caller's own tensor work around an engine call, e.g. a server's reply."""
        return fn() if self._worker is None else self._worker.call(fn)

    def close(self) -> None:
        """Stop the compute thread (later calls run on their caller's thread). Idempotent."""
        if self._worker is not None:
            self._worker.close()

    # -- sequences --------------------------------------------------------------

    @_computes
    def open(
        self,
        seq_id: str,
        token_ids: Seq[int] | np.ndarray,
        salt: bytes = b"",
        max_cached_tokens: int | None = None,
        expect_cached_tokens: int | None = None,
        attention: Seq[LayerAttention] | None = None,
        first_position: int = 0,
        named: tuple[int, bytes] | None = None,
    ) -> OpenResult:
        """Create a sequence starting with the longest cached prefix of `token_ids`
        (see KVCacheManager.open). The caller appends the remaining tokens' KV.

        `expect_cached_tokens` (the coordinator's asynchronous open: the client was
        already told this many tokens are cached) makes the hit exact: the sequence
        starts with exactly that many tokens, or is not opened (PrefixEvicted when
        the node holds fewer, evicted since the coordinator read its index). Such a
        failure is also kept as a tombstone, so the first data call on `seq_id`
        raises it instead of NOT_FOUND (await_sequence). `attention`: one LayerAttention per
        layer (or None), kept for the sequence and its forks (windows.py); `first_position`:
        a later extent's first token in the whole sequence, which its masks count from.
        `named` (an order that names its prompt, OpenRequest.prompt_key): (the prompt's length,
        the key its cached prefix must end with); `token_ids` is then that prefix, which the
        worker carried and which is refused (InvalidArgument, nothing kept) if it hashes to
        another key."""
        seq_id = seq_id_of(seq_id)
        want = expect_cached_tokens
        try:
            spec = self.specs.check(attention, first_position)
            tokens = token_list(token_ids, f"open {seq_id!r}")
            limit = max_cached_tokens if want is None else want
            if want is not None and (type(want) is not int or not 0 <= want <= len(tokens)):
                raise InvalidArgument(
                    f"expect_cached_tokens must be an int in [0, {len(tokens)}] (the prompt), got {want!r}"
                )
            if limit is not None and (type(limit) is not int or limit < 0):
                raise InvalidArgument(f"max_cached_tokens must be a non-negative int, got {limit!r}")
            with self._lock:
                res = self.manager.open(seq_id, tokens, bytes(salt), limit)
                if want is not None and res.num_cached_tokens != want:
                    self.manager.free(seq_id)  # back to exactly as before: the blocks stay cached
                    raise PrefixEvicted(seq_id, res.num_cached_tokens, want)
                if named is not None:
                    self._check_named(seq_id, len(tokens), *named)
                self.specs.set(seq_id, spec)
                self._waits.opened(seq_id)
                return res
        except PagedKVError as exc:
            if want is not None:  # an asynchronous open: its first data call learns why
                with self._lock:
                    if seq_id not in self.manager.seqs:  # not a duplicate id: the live one stays reachable
                        self._waits.failed(seq_id, exc)
            raise

    def _check_named(self, seq_id: str, num_carried: int, num_tokens: int, key: bytes) -> None:
        """The carried prefix of a named prompt hashes to the order's key (the keys open()
        computed, no second hash), else the sequence is freed and the open refused."""
        keys = self.manager.seqs[seq_id].keys
        last = (keys[-1] or b"") if keys else b""
        if not hmac.compare_digest(last, key):
            self.manager.free(seq_id)
            raise InvalidArgument(
                f"open {seq_id!r}: the prompt carried with the open order is not the one the "
                f"coordinator placed (its cached prefix of {num_carried} tokens hashes to another key)"
            )
        self.manager.counters.prefix_query_tokens += max(num_tokens - num_carried, 0)

    def await_sequence(self, seq_id: str, timeout_s: float | None = None) -> bool:
        """Wait (at most `timeout_s`, default config.unknown_seq_grace_s) until
        sequence `seq_id` exists. A data call can reach the node before the
        coordinator's asynchronous Open of the same sequence (another connection),
        so an unknown id is given this grace before NOT_FOUND. Returns True once it
        exists, False if it still does not; raises the open's own error (e.g.
        PrefixEvicted) if its asynchronous open failed. Changes nothing."""
        grace = self.open_grace(seq_id, self.config.unknown_seq_grace_s) if timeout_s is None else timeout_s
        return self._waits.wait(seq_id, self.manager.seqs.__contains__, grace)

    def awaiting_open(self, fn: Callable[[], T]) -> T:
        """fn(), called again when a sequence it did not find gets opened within the
        grace (await_sequence): what a server does for every data call, since one may
        overtake the coordinator's asynchronous Open. fn must change nothing when it
        raises SequenceNotFound (every method here validates first). Free when every
        sequence exists."""
        for _ in range(8):  # a batch may name several sequences still being opened
            try:
                return fn()
            except SequenceNotFound as exc:
                if not (isinstance(exc.seq_id, str) and self.await_sequence(exc.seq_id)):
                    raise self.missing(exc) from None
        return fn()

    @_computes
    def lookup(self, token_ids: Seq[int] | np.ndarray, salt: bytes = b"") -> int:
        """Tokens of this prompt cached on the node (device or host). Changes nothing."""
        tokens = token_list(token_ids, "lookup")
        with self._lock:
            return self.manager.num_cached_tokens(tokens, bytes(salt))

    @_computes
    def append(self, seq_id: str, token_ids: Seq[int], k: Any, v: Any) -> None:
        """Append n tokens with their K and V for every layer: k, v [num_layers, n, kv_heads, head_dim]."""
        seq_id = seq_id_of(seq_id)
        tokens = token_list(token_ids, f"append to {seq_id!r}")
        s = self.spec
        shape = (s.num_layers, len(tokens), s.num_kv_heads, s.head_dim)
        self._append(
            seq_id, tokens, [(self._checks.tensor("k", k, shape), self._checks.tensor("v", v, shape))]
        )

    @_computes
    def append_slabs(self, seq_id: str, token_ids: Seq[int], slabs: Seq[tuple[Any, Any]]) -> None:
        """append() with the K/V given as consecutive token slabs (k_i, v_i), each
        [num_layers, t_i, kv_heads, head_dim], sum t_i = n: what a streamed Append
        delivers, written without first joining it into one payload-sized tensor."""
        seq_id = seq_id_of(seq_id)
        tokens = token_list(token_ids, f"append to {seq_id!r}")
        self._append(seq_id, tokens, self._checks.kv_slabs(slabs, len(tokens)))

    def _append(self, seq_id: str, tokens: list[int], slabs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not tokens:
            return
        with self._lock:
            pos = self.manager.reserve(seq_id, tokens)  # after any budget drop; no slot list per token
            seq = self.manager.seqs[seq_id]
            for k, v in slabs:
                self._io.write_range(seq.table, pos, k, v)
                pos += k.shape[1]

    def _slot_index(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(slots.blocks, dtype=torch.long, device=self.device),
            torch.tensor(slots.offsets, dtype=torch.long, device=self.device),
        )

    def _tail_slots(self, seq_ids: list[str], n: int) -> Slots:
        """The slots of each sequence's last n tokens (written at layer 0 of this step)."""
        bs = self.spec.block_size
        blocks: list[int] = []
        offsets: list[int] = []
        for sid in seq_ids:
            seq = self.manager.get_active(sid)
            if seq.cache_len < n:
                raise InvalidArgument(
                    f"sequence {sid!r} holds {seq.cache_len} tokens; cannot write the last {n}"
                )
            for p in range(seq.cache_len - n, seq.cache_len):
                blocks.append(seq.table[p // bs])
                offsets.append(p % bs)
        return Slots(blocks, offsets)

    @_computes
    def attend_decode(
        self,
        seq_ids: Seq[str],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: Seq[int] | None = None,
        *,
        return_block_mass: bool = False,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        appends: Seq[bool] | None = None,
    ) -> AttentionOutput:
        """One decode step of one layer for a batch: q [B, q_heads, head_dim].

        With k, v [B, kv_heads, head_dim] the new token is appended first: at
        layer 0 `token_ids` (one per sequence) reserves its slot; later layers
        write into that slot and take no token_ids. Without k, v it only attends.
        `appends` (one flag per sequence): only the flagged rows append, and k, v,
        token_ids hold those rows (a sharded batch's tails beside earlier extents).
        Returns out [B, q_heads, head_dim], lse [B, q_heads] and, if asked, the
        attention mass per block. out: where to write out and lse (see paged_decode).
        """
        ids = batch_ids(seq_ids, "attend_decode", "decode")
        layer = self._checks.layer(layer)
        s = self.spec
        q = self._checks.query("q", q, (len(ids), None, s.head_dim))
        writers = self._checks.writers(ids, appends, k)
        tokens = self._checks.step_tokens(layer, k, v, token_ids, len(writers))
        k, v = self._checks.step_kv(k, v, len(writers))
        with self._lock:
            for sid in ids:
                self.manager.get_active(sid)
            if k is not None:
                if tokens is not None:
                    slots = self._layered.reserve(
                        self.manager, writers, lambda: self.manager.append_tokens(writers, tokens)
                    )
                else:
                    slots = self._tail_slots(writers, 1)
                self._io.write_layer(layer, *self._slot_index(slots), k, v)
                if layer == s.num_layers - 1:
                    self._layered.publish(self.manager, writers)
            seqs = [self.manager.seqs[sid] for sid in ids]
            width = max(len(seq.table) for seq in seqs)
            if width == 0:
                raise InvalidArgument("the sequences hold no tokens to attend to")
            tables = torch.tensor(
                [seq.table + [0] * (width - len(seq.table)) for seq in seqs], dtype=torch.int32
            )
            lens = torch.tensor([seq.cache_len for seq in seqs], dtype=torch.int32)
            if (lens == 0).any():
                empty = [sid for sid, seq in zip(ids, seqs, strict=True) if seq.cache_len == 0]
                raise InvalidArgument(f"sequences {empty} hold no tokens to attend to")
            want_mass = return_block_mass or tracks_mass(self.manager.device.policy, seqs)
            specs = self.specs.batch_specs(ids, layer, seqs)
            if specs is None:
                res = decode_trusted(
                    q,
                    self.kv[layer, 0],
                    self.kv[layer, 1],
                    tables,  # host tensors: the kernels check them there and move them once
                    lens,
                    return_block_mass=want_mass,
                    out=out,
                )
            else:
                res = self.specs.decode(
                    specs, q, self.kv[layer, 0], self.kv[layer, 1], tables, lens, want_mass, out
                )
                if layer == s.num_layers - 1:
                    self.specs.release(self.manager, ids)
            if want_mass and res.block_mass is not None:
                credit_mass(self.manager.device.policy, seqs, res.block_mass)
            return res

    @_computes
    def attend_prefill(
        self,
        seq_id: str,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: Seq[int] | None = None,
        *,
        return_block_mass: bool = False,
        query_position: int | None = None,
    ) -> AttentionOutput:
        """n query tokens of one sequence (q [n, q_heads, head_dim]) attending
        causally to its cached prefix and to themselves. With k, v [n, kv_heads,
        head_dim] the n tokens are appended first (token_ids at layer 0, as in
        attend_decode); without them q stands for the sequence's last n tokens, or,
        with `query_position`, for queries at that position of the whole sequence and
        on, past every token this node holds (an earlier extent: windows.py)."""
        seq_id = seq_id_of(seq_id)
        layer = self._checks.layer(layer)
        s = self.spec
        q = self._checks.query("q", q, (None, None, s.head_dim))
        n = q.shape[0]
        if n == 0:
            raise InvalidArgument("attend_prefill needs at least one query token")
        tokens = self._checks.step_tokens(layer, k, v, token_ids, n)
        k, v = self._checks.step_kv(k, v, n)
        with self._lock:
            seq = self.manager.get_active(seq_id)
            table = None
            if k is not None:
                if tokens is not None:
                    slots = self._layered.reserve(
                        self.manager, [seq_id], lambda: self.manager.append(seq_id, tokens)
                    )
                    self._io.write_layer(layer, *self._slot_index(slots), k, v)
                else:  # the slots layer 0 reserved: the table's last n positions (no per-token list)
                    if seq.cache_len < n:
                        raise InvalidArgument(
                            f"sequence {seq_id!r} holds {seq.cache_len} tokens; cannot write the last {n}"
                        )
                    table = torch.tensor(seq.table, dtype=torch.int64, device=self.device)
                    pos = torch.arange(seq.cache_len - n, seq.cache_len, device=self.device)
                    self._io.write_layer(layer, table[pos // s.block_size], pos % s.block_size, k, v)
                if layer == s.num_layers - 1:
                    self._layered.publish(self.manager, [seq_id])
            first_query = None
            if query_position is not None:
                if k is not None:
                    raise InvalidArgument("query_position is for queries without k and v")
                first_query = self.specs.check_past(seq_id, layer, seq, query_position, n)
            elif seq.cache_len < n:
                raise InvalidArgument(
                    f"sequence {seq_id!r} holds {seq.cache_len} tokens, fewer than {n} queries"
                )
            elif k is None:
                self.specs.check_queries(seq_id, layer, seq.num_tokens - n, seq.num_dropped_tokens)
            want_mass = return_block_mass or tracks_mass(self.manager.device.policy, [seq])
            if table is None:
                table = torch.tensor(seq.table, dtype=torch.int64, device=self.device)
            spec = self.specs.layer_spec(seq_id, layer)
            out = prefill_trusted(
                q,
                self.kv[layer, 0],
                self.kv[layer, 1],
                table,
                seq.cache_len,
                return_block_mass=want_mass,
                spec=spec,
                position_base=self.specs.base(seq_id, seq),
                first_query=first_query,
            )
            if want_mass and out.block_mass is not None:
                credit_mass(self.manager.device.policy, [seq], out.block_mass.unsqueeze(0))
            if spec.masks and layer == s.num_layers - 1:
                self.specs.release(self.manager, [seq_id])
            return out

    @_computes
    def attend_prefill_batch(
        self,
        seq_ids: Seq[str],
        layer: int,
        num_tokens: Seq[int],
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: Seq[int] | None = None,
    ) -> AttentionOutput:
        """attend_prefill for B sequences at one layer in one call: sequence i owns the next
        num_tokens[i] rows of q [N, q_heads, head_dim] (k, v [N, kv_heads, head_dim]; N token
        ids at layer 0), N = sum(num_tokens). Returns out [N, q_heads, head_dim] and lse
        [N, q_heads] in the same row order (no block mass).

            rows   0 ........ n_0 | n_0 ........ n_0 + n_1 | ... N
                   sequence 0     | sequence 1            | ...

        The whole request (distinct known active sequences, counts, shapes, token ids, enough
        tokens held when nothing is appended) is checked before anything changes, and the batch
        runs under the engine lock. Only running out of room at layer 0 fails after a change:
        the sequences before the one that did not fit keep their appended tokens."""
        ids = batch_ids(seq_ids, "attend_prefill_batch", "prefill")
        layer = self._checks.layer(layer)
        s = self.spec
        counts = list(num_tokens)
        if len(counts) != len(ids) or any(type(n) is not int or n < 1 for n in counts):
            raise InvalidArgument(
                f"num_tokens must hold one count >= 1 per sequence ({len(ids)}), got {counts}"
            )
        total = sum(counts)
        q = self._checks.query("q", q, (total, None, s.head_dim))
        tokens = self._checks.step_tokens(layer, k, v, token_ids, total)
        k, v = self._checks.step_kv(k, v, total)
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        with self._lock:
            for sid, n in zip(ids, counts, strict=True):
                seq = self.manager.get_active(sid)
                if tokens is None and seq.cache_len < n:  # nothing appended: q are its last n tokens
                    raise InvalidArgument(
                        f"sequence {sid!r} holds {seq.cache_len} tokens, fewer than {n} queries"
                    )
            outs: list[torch.Tensor] = []
            lses: list[torch.Tensor] = []
            for i, sid in enumerate(ids):
                a, b = bounds[i], bounds[i + 1]
                part = self.attend_prefill(
                    sid,
                    layer,
                    q[a:b],
                    None if k is None else k[a:b],
                    None if v is None else v[a:b],
                    None if tokens is None else tokens[a:b],
                )
                outs.append(part.out)
                lses.append(part.lse)
        if len(outs) == 1:
            return AttentionOutput(outs[0], lses[0], None)
        return AttentionOutput(torch.cat(outs), torch.cat(lses), None)

    @_computes
    def read_kv(
        self, seq_id: str, start: int = 0, end: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of cache positions [start, end), each [num_layers, n, kv_heads, head_dim].
        Changes nothing."""
        s = self.spec
        with self._lock:
            stop = self._read_range(seq_id_of(seq_id), start, end)
            shape = (s.num_layers, stop - start, s.num_kv_heads, s.head_dim)
            out_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            out_v = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.read_kv_into(seq_id, start, stop, out_k, out_v)
            return out_k.cpu(), out_v.cpu()  # one transfer on a GPU node; a no-op on CPU

    def _read_range(self, seq_id: str, start: int, end: int | None) -> int:
        """The validated end of [start, end) within the sequence (lock held)."""
        seq = self.manager.get_active(seq_id)
        stop = seq.cache_len if end is None else end
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop <= seq.cache_len:
            raise InvalidArgument(
                f"range [{start}, {end}) outside sequence {seq_id!r} of {seq.cache_len} tokens"
            )
        return stop

    @_computes
    def read_kv_into(
        self, seq_id: str, start: int, end: int, out_k: torch.Tensor, out_v: torch.Tensor
    ) -> None:
        """read_kv() into caller-owned tensors (the bulk channel's reused staging
        buffer, any device): out_k, out_v [num_layers, end - start, kv_heads, head_dim]
        of the node's dtype. Changes nothing in the engine."""
        seq_id = seq_id_of(seq_id)
        s = self.spec
        shape = (s.num_layers, end - start, s.num_kv_heads, s.head_dim)
        for name, out in (("out_k", out_k), ("out_v", out_v)):
            if tuple(out.shape) != shape or out.dtype != self.dtype:
                raise InvalidArgument(
                    f"{name} is {tuple(out.shape)} {out.dtype}, expected {shape} {self.dtype}"
                )
        with self._lock:
            stop = self._read_range(seq_id, start, end)
            self._io.read_range(self.manager.seqs[seq_id].table, start, stop, out_k, out_v)

    @_computes
    def fork(self, parent_id: str, child_id: str) -> None:
        with self._lock:
            self.manager.fork(seq_id_of(parent_id), seq_id_of(child_id))
            self.specs.fork(parent_id, child_id)

    @_computes
    def free(self, seq_id: str, keep_prefix: int | None = None) -> None:
        """Release the sequence (KVCacheManager.free: keep_prefix drops its cached blocks past
        that many tokens)."""
        with self._lock:
            self.manager.free(seq_id_of(seq_id), keep_prefix)
            self._layered.drop(seq_id)  # its unfinished blocks went back unkeyed
            self.specs.forget(seq_id)

    @_computes
    def swap_out(self, seq_id: str) -> int:
        with self._lock:
            moved = self.manager.swap_out(seq_id_of(seq_id))
            self._layered.drop(seq_id)  # an unfinished step's blocks are not published
            return moved

    @_computes
    def swap_in(self, seq_id: str) -> int:
        with self._lock:
            return self.manager.swap_in(seq_id_of(seq_id))

    @_computes
    def pin(self, token_ids: Seq[int], salt: bytes = b"") -> int:
        tokens = token_list(token_ids, "pin")
        with self._lock:
            return self.manager.pin(tokens, bytes(salt))

    @_computes
    def unpin(self, token_ids: Seq[int], salt: bytes = b"") -> int:
        tokens = token_list(token_ids, "unpin")
        with self._lock:
            return self.manager.unpin(tokens, bytes(salt))

    @_computes
    def set_budget(
        self, seq_id: str, max_tokens: int | None, sink_blocks: int = 1, recent_blocks: int = 4
    ) -> None:
        """Opt a sequence into a lossy token budget (None turns it off)."""
        seq_id = seq_id_of(seq_id)
        budget = None if max_tokens is None else Budget(max_tokens, sink_blocks, recent_blocks)
        with self._lock:
            if budget is not None:
                self.specs.check_budget(seq_id)
            self.manager.set_budget(seq_id, budget)

    @_computes
    def block_mass(self, seq_id: str, parts: Seq[tuple[int, Any, Seq[float], Seq[int]]]) -> list[float]:
        """Each block's mass (one per table entry), summed over parts (layer, q [n, q_heads,
        head_dim], lse: n * q_heads normalizers merged over every node, visible: n counts of
        this node's leading tokens each query saw; attention/given_mass.py). Changes nothing."""
        seq_id = seq_id_of(seq_id)
        checked = []
        for at, (layer, q, lse, visible) in enumerate(parts):
            layer = self._checks.layer(layer)
            q = self._checks.query("q", q, (None, None, self.spec.head_dim))
            n, hq = q.shape[0], q.shape[1]
            norm = torch.tensor(list(lse), dtype=torch.float32, device=self.device)
            seen = torch.tensor(list(visible), dtype=torch.int64)
            if n == 0 or norm.numel() != n * hq or seen.numel() != n or not bool(torch.isfinite(norm).all()):
                raise InvalidArgument(
                    f"block mass part {at}: needs n >= 1 queries, n * q_heads = {n * hq} finite lse "
                    f"and n visible counts; got {n} queries, {norm.numel()} lse, {seen.numel()} counts"
                )
            checked.append((layer, q, norm.view(n, hq), seen))
        with self._lock:
            seq = self.manager.get_active(seq_id)
            self._refuse_masks(seq_id, "block mass")
            by_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
            for at, (layer, q, norm, seen) in enumerate(checked):
                if int(seen.min()) < 1 or int(seen.max()) > seq.cache_len:
                    raise InvalidArgument(
                        f"block mass part {at}: visible counts must be in [1, {seq.cache_len}] "
                        f"(the tokens sequence {seq_id!r} holds), got {seen.tolist()[:8]}"
                    )
                by_layer.setdefault(layer, []).append((q, norm, seen))
            table = torch.tensor(seq.table, dtype=torch.int64, device=self.device)
            total = torch.zeros(len(seq.table), dtype=torch.float64)
            for layer, group in by_layer.items():  # a layer's keys read once for all its queries
                q, norm, seen = (torch.cat(t) for t in zip(*group, strict=True))
                spec = self.specs.layer_spec(seq_id, layer)
                mass = block_mass_given(q, norm, seen, self.kv[layer, 0], table, seq.cache_len, spec)
                total[: len(mass)] += mass.cpu()
            return total.tolist()

    def budget_scores(self, seq_id: str) -> tuple[list[float], int]:
        """The mass the sequence's budget has credited each block (one per table entry), and
        the tokens it holds."""
        seq_id = seq_id_of(seq_id)
        with self._lock:
            seq = self.manager.get_active(seq_id)
            self._refuse_masks(seq_id, "token budget")
            return list(seq.scores), seq.cache_len

    @_computes
    def drop_blocks(self, seq_id: str, indices: Seq[int]) -> int:
        """Drop whole blocks (table indices) a budget across nodes chose; returns the tokens
        kept. An unfinished layer-by-layer step of the sequence is never published."""
        seq_id = seq_id_of(seq_id)
        with self._lock:
            self._refuse_masks(seq_id, "dropping blocks")
            self.manager.drop_blocks(seq_id, [int(i) for i in indices])
            self._layered.drop(seq_id)
            return self.manager.get_active(seq_id).cache_len

    def _refuse_masks(self, seq_id: str, what: str) -> None:
        spec = self.specs.get(seq_id)
        if spec is not None and spec.masks:
            raise InvalidArgument(f"sequence {seq_id!r} has a sliding window or chunked attention: no {what}")

    @_computes
    def reset(self) -> None:
        """Forget every sequence and cached block (the node re-registered after its
        lease lapsed: the coordinator already marked its sequences lost and purged
        its keys, so it must come back empty). The tensors are kept, not zeroed."""
        with self._lock:
            self.manager = self._new_manager()
            self.specs.clear()
            self._waits.clear()
            self._layered.clear()

    def _new_manager(self) -> KVCacheManager:
        c = self.config
        return KVCacheManager(
            c.num_blocks,
            c.spec.block_size,
            num_host_blocks=c.num_host_blocks,
            policy=c.policy,
            enable_prefix_caching=c.enable_prefix_caching,
            mover=TensorMover({DEVICE: self.kv, HOST: self.host_kv}),
            record_events=True,
        )

    # -- introspection ----------------------------------------------------------

    def sequence_length(self, seq_id: str) -> int:
        """Logical length (tokens appended, including any dropped by a budget)."""
        with self._lock:
            return self.manager.get(seq_id_of(seq_id)).num_tokens

    def cache_length(self, seq_id: str) -> int:
        """Tokens the sequence holds in its blocks (read_kv's range)."""
        with self._lock:
            return self.manager.get_active(seq_id_of(seq_id)).cache_len

    def block_table(self, seq_id: str) -> list[int]:
        with self._lock:
            return list(self.manager.get(seq_id_of(seq_id)).table)

    def num_pending_events(self) -> int:
        """Events recorded and not yet taken. Lock-free (one length read), so a reporter
        thread can poll it often without touching the data path's lock."""
        return self.manager.num_pending_events

    def take_events(self) -> list[BlockEvent]:
        with self._lock:
            return self.manager.take_events()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.manager.stats()

    def check_integrity(self) -> None:
        with self._lock:
            self.manager.check_integrity()
            self.specs.check_integrity(self.manager)
