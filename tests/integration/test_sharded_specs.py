"""Attention specs and token budgets on sequences sharded across nodes (issue 20).

A soft-cap and a scale are per score: each node caps its own scores and the LSE merge over
the capped scores is exact, so such a sequence spills like a plain one; a sink (gpt-oss) is
folded in by the client after the merge. Windows and chunks spill too
(each extent's node counts the sequence's positions: test_sharded_windows.py); a budgeted
sequence spills too (test_sharded_budget.py).
Real parts as in test_sharded.py; checked against float64 dense attention.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_sharded import Q_HEADS, Reference, extent_sizes, spec_of, start_cluster

from pagedkv.protos.attention import LayerAttention
from pagedkv.protos.errors import InvalidArgument

CAPPED = (LayerAttention(softcap=5.0, scale=0.9), LayerAttention(softcap=2.0))


def capped_attention(
    ref: Reference, layer: int, q: torch.Tensor, first_query: int, sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] at positions first_query.. (causal) under CAPPED[layer], in float64; with a
    sink [Hq], one more logit per head in the softmax denominator (its value is zero)."""
    spec = CAPPED[layer]
    k, v = ref.k[layer].double(), ref.v[layer].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = spec.scale if spec.scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("nhd,lhd->nhl", q.double(), k) * scale
    scores = spec.softcap * torch.tanh(scores / spec.softcap)
    pos = torch.arange(k.shape[0])
    mask = pos[None, :] > (first_query + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    if sink is not None:
        lse = torch.logaddexp(lse, sink.double()[None, :])
    return torch.einsum("nhl,lhd->nhd", torch.exp(scores - lse[..., None]), v), lse


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bs", [1, 16])
def test_a_soft_capped_scaled_sequence_spills_and_attends_exactly(redis_url, bs):
    spec = spec_of(bs)
    for c in start_cluster(redis_url, spec, {"n1": 256, "n2": 256, "n3": 256}):
        ref = Reference(spec, seed=11)
        seq = c.client.open("capped", [0], attention=CAPPED, max_extent_tokens=3 * bs)
        k, v = ref.kv(4 * bs + 1)
        seq.append(list(range(4 * bs + 1)), k, v)
        seq.max_extent_tokens = 2 * bs
        sink = ref.rand(Q_HEADS)
        for step in range(2 * bs):  # decode across the second seal
            k, v = ref.kv(1)
            for layer in range(spec.num_layers):
                q = ref.rand(Q_HEADS, spec.head_dim)
                res = seq.attend(layer, q, k[layer, 0], v[layer, 0], step if layer == 0 else None)
                out, lse = capped_attention(ref, layer, q[None], ref.num_tokens - 1)
                close(res.out, out[0])
                close(res.lse, lse[0])
                # a sink folds into the merged result exactly as into one node's (hf_attend.py)
                folded = res.out * torch.sigmoid(res.lse - sink)[:, None]
                close(folded, capped_attention(ref, layer, q[None], ref.num_tokens - 1, sink)[0][0])
            c.check()
        seq.max_extent_tokens = None  # three nodes, three extents: the tail takes the rest
        start = ref.num_tokens
        k, v = ref.kv(bs + 3)
        for layer in range(spec.num_layers):  # a prefill over every extent
            q = ref.rand(bs + 3, Q_HEADS, spec.head_dim)
            res = seq.attend_prefill(
                layer, q, k[layer], v[layer], list(range(bs + 3)) if layer == 0 else None
            )
            out, lse = capped_attention(ref, layer, q, start)
            close(res.out, out)
            close(res.lse, lse)
        c.check()
        assert len(seq.extents) == 3 and extent_sizes(seq)[:2] == [3 * bs, 2 * bs]
        # every extent's node keeps the spec: a handle found by id attends the same
        other = c.client.sequence("capped")
        q = ref.rand(Q_HEADS, spec.head_dim)
        close(other.attend(1, q).out, capped_attention(ref, 1, q[None], ref.num_tokens - 1)[0][0])
        child = seq.fork("capped-child")
        assert child.attention == CAPPED and child.can_spill
        close(child.attend(0, q).out, capped_attention(ref, 0, q[None], ref.num_tokens - 1)[0][0])
        child.close()
        seq.close()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0
        c.check()


def test_a_full_node_spills_a_windowed_sequence_at_its_first_position(redis_url):
    """No max_extent_tokens: the node's RESOURCE_EXHAUSTED spills a windowed sequence as a
    plain one, and the new extent's node is opened with the extent's first position (it
    masks a chunk that does not start on its own first token exactly)."""
    spec = spec_of(4)
    chunked = (LayerAttention(chunk=6), LayerAttention(window=5))
    for c in start_cluster(redis_url, spec, {"n1": 3, "n2": 3}):
        ref = Reference(spec, seed=3)
        with c.client.open("c", [0], attention=chunked) as seq:
            assert seq.can_spill
            for _ in range(2):  # 4 blocks on a node of 3: the 4th spills
                k, v = ref.kv(8)
                seq.append(list(range(8)), k, v)
            assert extent_sizes(seq) == [8, 8]  # the second append found no room: all of it moved
            tail = c.engines[seq.extents[1].route.node_id]
            spec_there = tail.specs.get("c")
            assert spec_there is not None and spec_there.first_position == 8
            for layer, want_first in (
                (0, 12),
                (1, 11),
            ):  # chunk [12, 18), from inside the extent; window 11..15
                q = ref.rand(Q_HEADS, spec.head_dim)
                res = seq.attend(layer, q)
                k_l, v_l = ref.k[layer, want_first:].double(), ref.v[layer, want_first:].double()
                k_l, v_l = k_l.repeat_interleave(2, 1), v_l.repeat_interleave(2, 1)
                scores = torch.einsum("hd,lhd->hl", q.double(), k_l) / math.sqrt(spec.head_dim)
                close(res.lse, torch.logsumexp(scores, -1))
                close(res.out, torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v_l))
            with pytest.raises(InvalidArgument, match="first_position 3 is not a multiple of block_size 4"):
                tail.open("bad", [], attention=chunked, first_position=3)
            c.check()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0


def test_a_budgeted_sequence_spills_and_keeps_its_budget(redis_url):
    """The budget passes from the node to the client at the spill (test_sharded_budget.py
    shows the blocks kept are one node's); here: max_extent_tokens with a budget, and a
    full node under one."""
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 3, "n2": 3, "n3": 3}):
        with c.client.open("capped-size", [0], max_extent_tokens=8) as seq:
            seq.set_budget(12, sink_blocks=1, recent_blocks=1)
            k = torch.randn(spec.num_layers, 20, spec.num_kv_heads, spec.head_dim)
            for i in range(5):
                seq.append(list(range(4)), k[:, 4 * i : 4 * i + 4], k[:, 4 * i : 4 * i + 4])
            assert len(seq.extents) == 3 and seq.num_tokens == 20
            assert seq.read_kv()[0].shape[1] == 12  # the budget held across the spills
            assert c.client.counters["budget_dropped_blocks"] == 2
            c.check()
        with c.client.open("b", [0]) as seq:
            seq.append(list(range(8)), k[:, :8], k[:, :8])  # 2 blocks of its node's 3
            seq.set_budget(64, sink_blocks=1, recent_blocks=2)  # more than its node holds
            assert seq.append(list(range(8)), k[:, :8], k[:, :8]) == 16  # spilled, no drop
            assert len(seq.extents) == 2 and seq.read_kv()[0].shape[1] == 16
            with pytest.raises(InvalidArgument, match="max_tokens >= "):
                seq.set_budget(4, sink_blocks=1, recent_blocks=2)
            c.check()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0
