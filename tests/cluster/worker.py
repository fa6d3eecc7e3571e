"""A worker process for the cluster tests: opens a prompt through the
coordinator, appends the KV it would compute for the uncached rest, runs one
decode step on every layer, checks the node's attention against a float64
dense reference over the KV it expects, and prints one JSON line.

KV is a pure function of (position, token id), so two workers that share a
prompt prefix expect the same bytes for it: a reused prefix is checked, not
trusted.

    python tests/cluster/worker.py COORDINATOR SEQ_ID TOKEN PROMPT_JSON [--keep]
"""

from __future__ import annotations

import json
import math
import sys

import torch

from pagedkv.client import CacheClient
from pagedkv.process_env import freeze_at_exit
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_size=16)
Q_HEADS = 4


def expected_kv(token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, n, kv_heads, dim] K and V, each position seeded by (position, token)."""
    ks, vs = [], []
    for pos, tok in enumerate(token_ids):
        g = torch.Generator().manual_seed(pos * 1_000_003 + tok)
        ks.append(torch.randn(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, generator=g))
        vs.append(torch.randn(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, generator=g))
    return torch.stack(ks, 1), torch.stack(vs, 1)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D] over k, v [L, Hk, D], float64."""
    group = q.shape[0] // k.shape[1]
    k64 = k.double().repeat_interleave(group, 1)
    v64 = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k64) / math.sqrt(q.shape[-1])
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v64)


def main() -> None:
    coordinator, seq_id, token, prompt_json = sys.argv[1:5]
    keep = "--keep" in sys.argv
    prompt = json.loads(prompt_json)
    with CacheClient(coordinator=coordinator, token=token or None, spec=SPEC) as client:
        seq = client.open(seq_id, prompt)
        cached = seq.num_cached_tokens
        k, v = expected_kv(prompt)
        reused_ok = True
        if cached:
            got_k, got_v = seq.read_kv(0, cached)
            reused_ok = torch.equal(got_k, k[:, :cached]) and torch.equal(got_v, v[:, :cached])
        seq.append(prompt[cached:], k[:, cached:], v[:, cached:])
        new_token = 7
        nk, nv = expected_kv(prompt + [new_token])
        g = torch.Generator().manual_seed(99)
        max_err = 0.0
        for layer in range(SPEC.num_layers):
            q = torch.randn(Q_HEADS, SPEC.head_dim, generator=g)
            out = seq.attend(layer, q, nk[layer, -1], nv[layer, -1], new_token if layer == 0 else None)
            ref = dense(q, nk[layer], nv[layer])
            max_err = max(max_err, float((out.out.double() - ref).abs().max() / ref.abs().max()))
        if not keep:
            seq.close()
        print(
            json.dumps(
                {
                    "seq_id": seq_id,
                    "cached": cached,
                    "node": seq.route.node_id,
                    "reused_ok": reused_ok,
                    "max_rel_err": max_err,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    freeze_at_exit()  # exits in a fraction of a second, not seconds, with torch loaded
    main()
