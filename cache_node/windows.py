"""Each sequence's attention spec on the node, and the blocks its windows let go.

A sequence opened with an attention spec (one LayerAttention per layer, protos/attention.py)
keeps it until it is freed; a fork inherits its parent's. Every attend of the sequence runs its
layer's AttentionSpec (window, chunk, soft-cap, scale); a decode batch that mixes specs runs
one kernel call per distinct spec. Sequences opened without one cost the attend paths a single
test of an empty dict.

Windows free memory. After the last layer of an attend, the blocks that no query at the
sequence's last position or later sees in any layer (attention/spec.py: dead_prefix_blocks) leave
its table (KVCacheManager.release_leading): shared ones lose a reference, keyed ones stay cached
for prefix hits and are evicted (to the host tier first) like any cached block, the rest are
free. One layer without a window keeps every block. The node's positions stay table positions:

    sequence positions   0 ........ D-1 | D ............................ num_tokens - 1
    the table             (released)     | [ b7 | b2 | ... | b9 ]   cache_len = num_tokens - D

A window is a difference of positions, the same in both, so the kernels need no offset; a chunk
is not (t // C == p // C), so with chunked layers D stays a multiple of every chunk (blocks go a
whole chunk at a time, as a chunk ends). A query that would reach a released block (an attend
without new tokens for earlier positions than the last) is refused, never computed over a
shorter past. A token budget (lossy, middle blocks) is refused on such a sequence: it would
shift positions inside the window.

A later extent of a sequence sharded across nodes (coordinator/extents.py) is opened with its
first token's position in the whole sequence (`first_position`, a block multiple): masks count
absolute positions, table position t being first_position + D + t. A window needs nothing more;
a chunk whose edges do not fall on this node's table edges is masked, in a decode, as the window
of the keys the query's chunk holds here (one kernel call per such row: the kernels take one
window per call), and a prefill passes the base to the kernel. An earlier extent is attended by
queries past its last token (AttendPrefill's query_position), masked the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..protos.attention import LayerAttention, check_layers
from ..protos.errors import IntegrityError, InvalidArgument
from .attention import AttentionOutput
from .attention.decode import decode_trusted
from .attention.spec import PLAIN, AttentionSpec, dead_prefix_blocks, from_layer
from .kv.sequence import Sequence as KVSequence
from .kv_manager import KVCacheManager

__all__ = ["SequenceSpec", "SequenceSpecs"]


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence's spec on the node: per layer, and what releasing blocks needs of it."""

    layers: tuple[AttentionSpec, ...]
    masks: bool  # some layer has a window or chunks
    release_step: int  # blocks are released in multiples of this many (chunks); 0: never
    first_position: int = 0  # this extent's first token in the whole sequence (module docstring)

    @staticmethod
    def of(layers: Sequence[LayerAttention], block_size: int, first_position: int = 0) -> SequenceSpec:
        specs = tuple(from_layer(layer) for layer in layers)
        masks = any(s.masks for s in specs)
        step = 0
        if masks and all(s.masks for s in specs):  # one full layer keeps every block
            step = 1
            for s in specs:
                # D * block_size must be a multiple of the chunk (a later extent's rows are
                # masked as windows whatever D is: row_spec)
                if s.chunk and not first_position:
                    step = math.lcm(step, math.lcm(s.chunk, block_size) // block_size)
        return SequenceSpec(specs, masks, step, first_position)

    def releasable(self, last_pos: int, block_size: int) -> int:
        """Leading blocks (of this node's, from its first) no query at `last_pos` (counted on
        this node) or later sees in any layer, rounded down to the release step."""
        if not self.release_step:
            return 0
        first = self.first_position
        dead = dead_prefix_blocks(self.layers, last_pos + first, block_size) - first // block_size
        dead = max(dead, 0)
        return dead - dead % self.release_step

    def base(self, seq: KVSequence) -> int:
        """The position in the whole sequence of table position 0."""
        return self.first_position + seq.num_dropped_tokens

    def row_spec(self, layer: int, seq: KVSequence) -> AttentionSpec:
        """The layer's spec for a decode query at the sequence's last token: a chunk whose edges
        are not this table's becomes the window of the keys the query's chunk holds here."""
        spec = self.layers[layer]
        base = self.base(seq)
        if not spec.chunk or base % spec.chunk == 0:
            return spec
        last = base + seq.cache_len - 1
        return replace(spec, window=last - spec.first_visible(last) + 1, chunk=0)


class SequenceSpecs:
    """The specs of a node's sequences (seq id -> SequenceSpec). Not thread-safe: the engine
    calls it under its lock."""

    def __init__(self, num_layers: int, block_size: int) -> None:
        self.num_layers, self.block_size = num_layers, block_size
        self._by_seq: dict[str, SequenceSpec] = {}

    # -- lifecycle (open, fork, free) ---------------------------------------------------

    def check(self, layers: Sequence[LayerAttention] | None, first_position: int = 0) -> SequenceSpec | None:
        """The spec an open asks for, checked against the node's model (InvalidArgument naming
        what does not fit); None for plain attention. Changes nothing."""
        checked = check_layers(layers, self.num_layers)
        bs = self.block_size
        if isinstance(first_position, bool) or not isinstance(first_position, int) or first_position < 0:
            raise InvalidArgument(f"first_position must be an int >= 0, got {first_position!r}")
        if first_position % bs:
            raise InvalidArgument(f"first_position {first_position} is not a multiple of block_size {bs}")
        return SequenceSpec.of(checked, bs, first_position) if checked else None

    def set(self, seq_id: str, spec: SequenceSpec | None) -> None:
        """`seq_id` was just opened with `spec`."""
        if spec is None:
            self._by_seq.pop(seq_id, None)
        else:
            self._by_seq[seq_id] = spec

    def fork(self, parent_id: str, child_id: str) -> None:
        spec = self._by_seq.get(parent_id)
        if spec is not None:
            self._by_seq[child_id] = spec

    def forget(self, seq_id: str) -> None:
        self._by_seq.pop(seq_id, None)

    def clear(self) -> None:
        self._by_seq.clear()

    def get(self, seq_id: str) -> SequenceSpec | None:
        return self._by_seq.get(seq_id)

    def check_budget(self, seq_id: str) -> None:
        """Refuse a token budget on a sequence whose layers mask by position."""
        spec = self._by_seq.get(seq_id)
        if spec is not None and spec.masks:
            raise InvalidArgument(
                f"sequence {seq_id!r} has a sliding window or chunked attention: a token budget would "
                "move positions inside it (the node already releases the blocks no layer sees)"
            )

    # -- attend ---------------------------------------------------------------------------

    def layer_spec(self, seq_id: str, layer: int) -> AttentionSpec:
        spec = self._by_seq.get(seq_id)
        return PLAIN if spec is None else spec.layers[layer]

    def batch_specs(
        self, seq_ids: Sequence[str], layer: int, seqs: Sequence[KVSequence]
    ) -> list[AttentionSpec] | None:
        """Each sequence's spec at `layer` for a decode query at its last token, or None when
        every one is plain (the usual case)."""
        by_seq = self._by_seq
        if not by_seq:
            return None
        got = [by_seq.get(sid) for sid in seq_ids]
        if not any(got):
            return None
        return [PLAIN if s is None else s.row_spec(layer, seq) for s, seq in zip(got, seqs, strict=True)]

    def base(self, seq_id: str, seq: KVSequence) -> int:
        """The position in the whole sequence of the table's first token."""
        spec = self._by_seq.get(seq_id)
        return seq.num_dropped_tokens if spec is None else spec.base(seq)

    def check_past(self, seq_id: str, layer: int, seq: KVSequence, query_position: int, n: int) -> int:
        """The table position of the first of n queries at `query_position` (in the whole
        sequence) and on, which must come after every token this node holds and see at least one
        of them that is not released; InvalidArgument otherwise."""
        if isinstance(query_position, bool) or not isinstance(query_position, int):
            raise InvalidArgument(f"query_position must be an int, got {query_position!r}")
        spec = self._by_seq.get(seq_id)
        first = 0 if spec is None else spec.first_position
        layer_spec = PLAIN if spec is None else spec.layers[layer]
        end = first + seq.num_tokens
        if query_position < end:
            raise InvalidArgument(
                f"sequence {seq_id!r}: query_position {query_position} is not past its last position "
                f"{end - 1} on this node"
            )
        last_seen = layer_spec.first_visible(query_position + n - 1)
        if last_seen >= end:
            raise InvalidArgument(
                f"sequence {seq_id!r}: the query at {query_position + n - 1} sees none of its positions "
                f"{first}..{end - 1} on this node at layer {layer}"
            )
        released = first + seq.num_dropped_tokens
        if seq.num_dropped_tokens and layer_spec.first_visible(query_position) < released:
            raise InvalidArgument(
                f"sequence {seq_id!r}: a query at {query_position} sees from position "
                f"{layer_spec.first_visible(query_position)} at layer {layer}, but positions before "
                f"{released} were released"
            )
        return query_position - released

    def decode(
        self,
        specs: list[AttentionSpec],
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        return_block_mass: bool,
        out: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> AttentionOutput:
        """decode_trusted with each row's spec: one call per distinct spec (one in the usual
        case of a batch of one model), the rows put back in batch order."""
        first = specs[0]
        if all(s == first for s in specs):
            return decode_trusted(
                q, k_cache, v_cache, tables, lens, return_block_mass=return_block_mass, out=out, spec=first
            )
        batch, num_q_heads, head_dim = q.shape
        res_out, res_lse = (
            out if out is not None else (torch.empty_like(q), q.new_empty(batch, num_q_heads).float())
        )
        mass = torch.zeros(batch, tables.shape[1], device=q.device) if return_block_mass else None
        for spec in dict.fromkeys(specs):
            rows = torch.tensor([i for i, s in enumerate(specs) if s == spec])
            part = decode_trusted(
                q[rows],
                k_cache,
                v_cache,
                tables[rows],
                lens[rows],
                return_block_mass=return_block_mass,
                spec=spec,
            )
            res_out[rows] = part.out
            res_lse[rows] = part.lse
            if mass is not None and part.block_mass is not None:
                mass[rows.to(mass.device)] = part.block_mass.to(mass.dtype)
        return AttentionOutput(res_out, res_lse, mass)

    def check_queries(self, seq_id: str, layer: int, first_pos: int, num_released: int) -> None:
        """Refuse queries from `first_pos` on (sequence positions) when the layer's spec would
        let them see a released token."""
        spec = self._by_seq.get(seq_id)
        if spec is None or not num_released:
            return
        first = spec.first_position
        lo = spec.layers[layer].first_visible(first_pos + first) - first
        if lo < num_released:
            raise InvalidArgument(
                f"sequence {seq_id!r}: a query at position {first_pos} sees from position {lo} at layer "
                f"{layer}, but its first {num_released} tokens were released (outside every window)"
            )

    # -- releasing ------------------------------------------------------------------------

    def release(self, manager: KVCacheManager, seq_ids: Sequence[str]) -> int:
        """After the last layer of an attend: release each sequence's blocks that no later
        query sees. Returns the number of blocks released."""
        by_seq = self._by_seq
        if not by_seq:
            return 0
        bs = self.block_size
        released = 0
        for sid in seq_ids:
            spec = by_seq.get(sid)
            if spec is None or not spec.release_step:
                continue
            seq = manager.seqs[sid]
            last = seq.num_tokens - 1
            have = seq.num_dropped_tokens // bs
            want = spec.releasable(last, bs)
            if want > have:
                released += manager.release_leading(sid, want - have)
        return released

    def check_integrity(self, manager: KVCacheManager) -> None:
        """Raise IntegrityError unless every spec belongs to a live sequence, and every
        sequence released only blocks no query at its last position sees, in whole release
        steps, with no token budget."""
        problems = []
        bs = self.block_size
        for sid, spec in self._by_seq.items():
            seq = manager.seqs.get(sid)
            if seq is None:
                problems.append(f"attention spec kept for unknown sequence {sid!r}")
                continue
            dropped = seq.num_dropped_tokens
            if not dropped:
                continue
            blocks = dropped // bs
            dead = spec.releasable(max(seq.num_tokens - 1, 0), bs)
            step = spec.release_step
            if seq.budget is not None or dropped % bs or blocks > dead or not step or blocks % step:
                problems.append(
                    f"sequence {sid!r} released {dropped} tokens; {dead} blocks of {bs} are outside "
                    f"every window at position {seq.num_tokens - 1} (step {spec.release_step}, "
                    f"budget {seq.budget})"
                )
        if problems:
            raise IntegrityError("; ".join(problems))
