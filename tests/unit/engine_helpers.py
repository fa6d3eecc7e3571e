"""Small shared helpers for the engine tests: a tiny engine, a float64 dense
attention reference, and a snapshot of everything a failed call must not change."""

from __future__ import annotations

import math

import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
Q_HEADS = 4


def make_engine(num_blocks: int = 16, num_host_blocks: int = 8, policy: str = "lru", **kw) -> CacheEngine:
    spec = kw.pop("spec", SPEC)
    return CacheEngine(EngineConfig(spec, num_blocks, num_host_blocks, policy, device="cpu", **kw))


def kv_for(n: int, seed: int, spec: ModelSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def fill(engine: CacheEngine, seq_id: str, tokens: list[int], seed: int = 0, salt: bytes = b"") -> int:
    """Open `seq_id` with `tokens` and append the uncached rest with KV derived
    from (seed, position) so equal prefixes get equal KV. Returns cached tokens."""
    cached = engine.open(seq_id, tokens, salt).num_cached_tokens
    rest = tokens[cached:]
    if rest:
        k, v = kv_for(len(tokens), seed, engine.spec)
        engine.append(seq_id, rest, k[:, cached:], v[:, cached:])
    return cached


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> tuple:
    """float64 reference: q [n, Hq, D] at positions first_pos.., k/v [L, Hk, D] -> (out, lse)."""
    n, hq, d = q.shape
    hk = k.shape[1]
    q64, k64, v64 = (
        q.double(),
        k.double().repeat_interleave(hq // hk, 1),
        v.double().repeat_interleave(hq // hk, 1),
    )
    scores = torch.einsum("nhd,lhd->hnl", q64, k64) / math.sqrt(d)
    pos = torch.arange(k.shape[0])
    mask = pos[None, :] > (first_pos + torch.arange(n))[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [h, n]
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), v64)
    return out, lse.T


def snapshot(engine: CacheEngine) -> tuple:
    """Everything a rejected request must leave exactly as it was."""
    m = engine.manager
    seqs = {
        sid: (list(s.tokens), list(s.table), list(s.keys), s.cache_len, s.host_table and list(s.host_table))
        for sid, s in m.seqs.items()
    }
    return (
        engine.stats(),
        seqs,
        list(m.device.refcount),
        list(m.host.refcount),
        m.device.policy.victims_in_order(),
        engine.kv.clone(),
        engine.host_kv.clone(),
    )


def assert_unchanged(before: tuple, engine: CacheEngine) -> None:
    after = snapshot(engine)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"tensor {i} changed"
        else:
            assert a == b, f"state part {i} changed:\n{a}\n!=\n{b}"
    engine.check_integrity()
