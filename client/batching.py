"""Splitting a batch across the nodes its sequences live on, and putting the answers back
in the batch's row order: a decode batch (one row per sequence) or a prefill batch (sequence
i owns the next num_tokens[i] rows). A batch on one node passes through without copies."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from ..protos.errors import InvalidArgument
from . import codec
from .types import AttentionResult


def _by_node(where: list[tuple[str, str]]) -> dict[str, list[int]]:
    """address -> the indices of the batch's (address, seq_id) entries on that node, in order."""
    groups: dict[str, list[int]] = {}
    for i, (address, _) in enumerate(where):
        groups.setdefault(address, []).append(i)
    return groups


@dataclass(frozen=True)
class BatchPart:
    """The rows of a decode batch that live on one node."""

    address: str
    rows: list[int]
    seq_ids: list[str]
    q: Any
    k: Any
    v: Any
    token_ids: list[int] | None


def split_batch(
    where: list[tuple[str, str]], q: Any, k: Any, v: Any, token_ids: codec.TokenIds | None
) -> list[BatchPart]:
    """Group a batch's rows ((address, seq_id) each) by node; one part (no copies) when all share one."""
    groups = _by_node(where)
    tokens = None if token_ids is None else codec.token_list(token_ids)
    if len(groups) == 1:
        return [BatchPart(where[0][0], list(range(len(where))), [s for _, s in where], q, k, v, tokens)]
    parts = []
    for address, rows in groups.items():
        pick = torch.tensor(rows)
        parts.append(
            BatchPart(
                address,
                rows,
                [where[i][1] for i in rows],
                q[pick],
                None if k is None else k[pick],
                None if v is None else v[pick],
                None if tokens is None else [tokens[i] for i in rows],
            )
        )
    return parts


@dataclass(frozen=True)
class PrefillPart:
    """The sequences of a prefill batch that live on one node, with their rows."""

    address: str
    rows: list[int]  # indices into the batch's N rows
    seq_ids: list[str]
    num_tokens: list[int]
    q: Any
    k: Any
    v: Any
    token_ids: list[int] | None


def check_counts(num_tokens: Seq[int], num_seqs: int) -> None:
    if len(num_tokens) != num_seqs:
        raise InvalidArgument(f"{len(num_tokens)} token counts for {num_seqs} sequences")


def split_prefill_batch(
    where: list[tuple[str, str]],
    num_tokens: Seq[int],
    q: Any,
    k: Any,
    v: Any,
    token_ids: codec.TokenIds | None,
) -> list[PrefillPart]:
    """Group a prefill batch's sequences ((address, seq_id) each, sequence i owning the next
    num_tokens[i] rows) by node; one part (no copies) when all share one."""
    counts = [int(n) for n in num_tokens]
    check_counts(counts, len(where))
    tokens = None if token_ids is None else codec.token_list(token_ids)
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    groups = _by_node(where)
    if len(groups) == 1:
        rows = list(range(starts[-1]))
        return [PrefillPart(where[0][0], rows, [s for _, s in where], counts, q, k, v, tokens)]
    parts = []
    for address, members in groups.items():
        rows = [r for i in members for r in range(starts[i], starts[i + 1])]
        pick = torch.tensor(rows)
        parts.append(
            PrefillPart(
                address,
                rows,
                [where[i][1] for i in members],
                [counts[i] for i in members],
                q[pick],
                None if k is None else k[pick],
                None if v is None else v[pick],
                None if tokens is None else [tokens[r] for r in rows],
            )
        )
    return parts


def gather_rows(parts: list[tuple[list[int], AttentionResult]], n: int) -> AttentionResult:
    """Reassemble per-node results into the batch's row order."""
    first = parts[0][1]
    out = first.out.new_empty((n, *first.out.shape[1:]))
    lse = first.lse.new_empty((n, *first.lse.shape[1:]))
    for rows, res in parts:
        out[rows] = res.out
        lse[rows] = res.lse
    if first.block_mass is None:
        return AttentionResult(out, lse)
    width = max(res.block_mass.shape[1] for _, res in parts if res.block_mass is not None)
    mass = first.block_mass.new_zeros((n, width))
    for rows, res in parts:
        assert res.block_mass is not None
        mass[rows, : res.block_mass.shape[1]] = res.block_mass
    return AttentionResult(out, lse, mass)
