"""Helpers shared by the transformers end-to-end tests (prompts, padding, comparisons)."""

from __future__ import annotations

import torch

LOGIT_TOL = 1e-4


def prompt_ids(seed: int, length: int) -> torch.Tensor:
    """Random token ids in [3, vocab): never pad (0), bos (1) or eos (2)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=g)


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return ids, mask


def assert_same_generation(out, ref, tol: float = LOGIT_TOL) -> None:
    """Identical tokens, and every step's logits within tol."""
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    got, want = torch.stack(out.logits), torch.stack(ref.logits)
    err = (got - want).abs().max().item()
    assert err < tol, f"max logit error {err:.2e}"
