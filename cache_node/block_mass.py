"""The attention mass per block an attend computed, credited where eviction reads it: the
score policy's ranking and each budgeted sequence's per-block scores (DESIGN.md: eviction)."""

from __future__ import annotations

import numpy as np
import torch

from .eviction import ScorePolicy
from .kv.sequence import Sequence


def tracks_mass(policy: object, seqs: list[Sequence]) -> bool:
    """Whether an attend must compute the attention mass per block: a score policy ranks
    blocks by it, a token budget drops the least attended ones."""
    return isinstance(policy, ScorePolicy) or any(s.budget is not None for s in seqs)


def credit_mass(policy: object, seqs: list[Sequence], block_mass: torch.Tensor) -> None:
    """Add one attend's mass per block [len(seqs), >= blocks] to the policy and the budgets."""
    mass = block_mass.detach().to("cpu", torch.float64).numpy()
    if isinstance(policy, ScorePolicy):
        for row, seq in zip(mass, seqs, strict=True):
            n = len(seq.table)
            policy.add_mass_many(np.asarray(seq.table, dtype=np.int64), row[:n])
    for row, seq in zip(mass, seqs, strict=True):
        if seq.budget is not None:
            for i in range(len(seq.table)):
                seq.scores[i] += float(row[i])
