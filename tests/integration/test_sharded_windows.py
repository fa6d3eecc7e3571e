"""Sliding windows and chunked attention over sequences sharded across nodes (issue 20).

Each extent's node counts the sequence's absolute positions (its Open names its first one);
the client skips the extents wholly outside a query's window or chunk and sends a query past
an extent the window's edge cuts with its position. Real parts as in test_sharded.py (three
node engines over gRPC, a coordinator on a real Redis), uneven extents forced by
max_extent_tokens, every result checked against float64 dense attention under the same mask
and every node's integrity after every step.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_sharded import Q_HEADS, Cluster, Reference, extent_sizes, spec_of, start_cluster

from pagedkv.client import Sequence
from pagedkv.protos.attention import LayerAttention


def masked_attention(
    ref: Reference, spec: LayerAttention, layer: int, q: torch.Tensor, first_query: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] at positions first_query.. under `spec` (window, chunk, soft-cap, scale),
    over the reference's keys, in float64."""
    k, v = ref.k[layer].double(), ref.v[layer].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = spec.scale if spec.scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("nhd,lhd->nhl", q.double(), k) * scale
    if spec.softcap:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    key = torch.arange(k.shape[0])[None, :]
    query = (first_query + torch.arange(q.shape[0]))[:, None]
    hidden = key > query
    if spec.window:
        hidden |= key <= query - spec.window
    if spec.chunk:
        hidden |= key // spec.chunk != query // spec.chunk
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("nhl,lhd->nhd", torch.exp(scores - lse[..., None]), v), lse


def close(res, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(res.out.double(), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res.lse.double(), want[1], atol=1e-4, rtol=1e-4)


def specs_for(case: str, bs: int) -> tuple[LayerAttention, LayerAttention]:
    """Two layers' specs, sized against extents of 3 and 2 blocks."""
    return {
        # both layers mask: the tails release what no window sees, counted from their first position
        "window<extent": (LayerAttention(window=bs + 1), LayerAttention(window=2 * bs - 1 or 1)),
        "window=extent": (LayerAttention(window=2 * bs), LayerAttention(window=3 * bs)),
        "window>extent": (LayerAttention(window=4 * bs + 2), LayerAttention()),
        "window-on-block-edges": (LayerAttention(window=bs), LayerAttention(window=2 * bs, softcap=3.0)),
        "chunk": (LayerAttention(chunk=2 * bs + 1), LayerAttention(chunk=4 * bs)),
        "chunk-window-cap": (
            LayerAttention(window=3 * bs - 1, chunk=4 * bs, softcap=3.0, scale=0.7),
            LayerAttention(chunk=bs + 2),
        ),
    }[case]


CASES = [
    "window<extent",
    "window=extent",
    "window>extent",
    "window-on-block-edges",
    "chunk",
    "chunk-window-cap",
]


def step(c: Cluster, seq: Sequence, ref: Reference, layers: tuple[LayerAttention, ...], token: int) -> None:
    """One decode step over every layer, checked against the masked reference."""
    k, v = ref.kv(1)
    for layer in range(c.spec.num_layers):
        q = ref.rand(Q_HEADS, c.spec.head_dim)
        res = seq.attend(layer, q, k[layer, 0], v[layer, 0], token if layer == 0 else None)
        want = masked_attention(ref, layers[layer], layer, q[None], ref.num_tokens - 1)
        close(res, (want[0][0], want[1][0]))
    c.check()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bs", [1, 16])
def test_a_windowed_or_chunked_sequence_spills_and_attends_exactly(redis_url, bs, case):
    spec = spec_of(bs)
    layers = specs_for(case, bs)
    for c in start_cluster(redis_url, spec, {"n1": 256, "n2": 256, "n3": 256}):
        ref = Reference(spec, seed=5)
        seq = c.client.open("w", [0], attention=layers, max_extent_tokens=3 * bs)
        assert seq.can_spill
        k, v = ref.kv(3 * bs + 1)
        seq.append(list(range(3 * bs + 1)), k, v)  # two extents: 3 blocks, then the tail
        seq.max_extent_tokens = 2 * bs

        for token in range(3 * bs):  # decode across the second seal: three extents of 3, 2 blocks, tail
            step(c, seq, ref, layers, token)
        assert extent_sizes(seq)[:2] == [3 * bs, 2 * bs] and len(seq.extents) == 3
        seq.max_extent_tokens = None
        # a prefill whose queries straddle the window's or chunk's edges over every extent
        for n in (bs + 3, 1, 2 * bs):
            start = ref.num_tokens
            k, v = ref.kv(n)
            for layer in range(spec.num_layers):
                q = ref.rand(n, Q_HEADS, spec.head_dim)
                tokens = list(range(n)) if layer == 0 else None
                res = seq.attend_prefill(layer, q, k[layer], v[layer], tokens)
                close(res, masked_attention(ref, layers[layer], layer, q, start))
            c.check()
        # a query standing for the last token (no k; earlier ones may see released blocks)
        for layer in range(spec.num_layers):
            q = ref.rand(1, Q_HEADS, spec.head_dim)
            close(
                seq.attend_prefill(layer, q),
                masked_attention(ref, layers[layer], layer, q, ref.num_tokens - 1),
            )
        step(c, seq, ref, layers, 7)
        # a fork shares every extent and keeps each one's first position
        child = seq.fork("w-child")
        q = ref.rand(Q_HEADS, spec.head_dim)
        want = masked_attention(ref, layers[0], 0, q[None], ref.num_tokens - 1)
        close(child.attend(0, q), (want[0][0], want[1][0]))
        child.close()
        seq.close()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0
        c.check()


def test_extents_outside_the_window_are_not_attended(redis_url):
    """A window of 2 blocks over extents of 3, 3, 3 blocks and a tail: once the window has
    left an extent, a decode step makes no call for it (fewer attends, counted)."""
    bs = 4
    spec = spec_of(bs)
    layers = (LayerAttention(window=2 * bs), LayerAttention(window=2 * bs))
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64, "n3": 64, "n4": 64}):
        ref = Reference(spec, seed=9)
        seq = c.client.open("w", [0], attention=layers, max_extent_tokens=3 * bs)
        k, v = ref.kv(9 * bs + 1)
        seq.append(list(range(9 * bs + 1)), k, v)
        assert len(seq.extents) == 4
        before = dict(c.client.counters)
        k, v = ref.kv(1)
        q = ref.rand(Q_HEADS, spec.head_dim)
        res = seq.attend(0, q, k[0, 0], v[0, 0], 1)
        want = masked_attention(ref, layers[0], 0, q[None], ref.num_tokens - 1)
        close(res, (want[0][0], want[1][0]))
        # the query at 9*bs+1 sees 7*bs+2 .. 9*bs+1: extents 0 and 1 lie wholly before it
        assert c.client.counters["window_skipped_attends"] - before["window_skipped_attends"] == 2
        assert c.client.counters["sharded_attends"] - before["sharded_attends"] == 2
        c.check()
        seq.close()


def test_a_batch_mixes_sharded_unsharded_windowed_and_plain_rows(redis_url):
    bs = 4
    spec = spec_of(bs)
    windowed = (LayerAttention(window=5), LayerAttention(chunk=6))
    plain = (LayerAttention(), LayerAttention())
    for c in start_cluster(redis_url, spec, {"n1": 256, "n2": 256, "n3": 256, "n4": 256}):
        rows = []
        for i, (layers, limit, length) in enumerate(
            [
                (windowed, 2 * bs, 5 * bs + 1),
                (windowed, None, 3 * bs),
                (plain, 3 * bs, 4 * bs + 3),
                (plain, None, 5),
            ]
        ):
            ref = Reference(spec, seed=20 + i)
            seq = c.client.open(f"r{i}", [0], attention=layers, max_extent_tokens=limit)
            k, v = ref.kv(length)
            seq.append(list(range(length)), k, v)
            rows.append((seq, ref, layers))
        assert [len(s.extents) for s, _, _ in rows] == [3, 1, 2, 1]
        handles = [s for s, _, _ in rows]
        for token in range(2 * bs + 1):
            kv = [ref.kv(1) for _, ref, _ in rows]
            for layer in range(spec.num_layers):
                q = torch.stack([ref.rand(Q_HEADS, spec.head_dim) for _, ref, _ in rows])
                k = torch.stack([kk[layer, 0] for kk, _ in kv])
                v = torch.stack([vv[layer, 0] for _, vv in kv])
                res = c.client.attend_batch(handles, layer, q, k, v, [token] * 4 if layer == 0 else None)
                for i, (_, ref, layers) in enumerate(rows):
                    want = masked_attention(ref, layers[layer], layer, q[i : i + 1], ref.num_tokens - 1)
                    torch.testing.assert_close(res.out[i].double(), want[0][0], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(res.lse[i].double(), want[1][0], atol=1e-4, rtol=1e-4)
            c.check()
        assert len(rows[0][0].extents) == 4  # the windowed row kept spilling in the batch
        for seq, _, _ in rows:
            seq.close()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0
