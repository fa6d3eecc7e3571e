"""paged prefill of a later extent (its table starts at position `position_base` of the
sequence) and of queries past every key (an earlier extent attended by later queries), on the
CPU paths (one masked flash call, and the explicit chunked scores), against test_attention_mods'
float64 reference with the same absolute positions. And the node's per-sequence view of it:
the blocks a later extent may release, and the queries it refuses (cache_node/windows.py)."""

from __future__ import annotations

import pytest
import torch
from attention_reference import LSE_TOL, OUT_TOL, make_scenario
from test_attention_mods import HEAD_DIM, SPECS, dense

from pagedkv.cache_node.attention import prefill
from pagedkv.cache_node.attention.prefill import prefill_trusted
from pagedkv.cache_node.windows import SequenceSpec
from pagedkv.protos.attention import LayerAttention
from pagedkv.protos.errors import InvalidArgument

MASKED = ["window1", "window5", "window17", "chunk4", "chunk16", "window_chunk", "window_softcap_sinks"]


def run(spec_name: str, block_size: int, base: int, first: int | None, n: int, mass: bool):
    spec = SPECS[spec_name]
    context_len = 45
    sc = make_scenario([context_len], num_kv_heads=2, block_size=block_size, head_dim=HEAD_DIM, seed=3)
    q = torch.randn(n, 8, HEAD_DIM)
    res = prefill_trusted(
        q,
        sc.k_cache,
        sc.v_cache,
        sc.tables[0].long(),
        context_len,
        return_block_mass=mass,
        spec=spec,
        position_base=base,
        first_query=first,
    )
    start = context_len - n if first is None else first
    out, lse, _ = dense(
        q,
        sc.keys[0],
        sc.values[0],
        base + torch.arange(start, start + n),
        spec,
        base + torch.arange(context_len),
    )
    torch.testing.assert_close(res.out.double(), out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(res.lse.double(), lse, **LSE_TOL)


@pytest.mark.parametrize("explicit", [False, True], ids=["flash", "explicit"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("base", [0, 16, 37])
@pytest.mark.parametrize("name", MASKED)
def test_a_later_extents_prefill_counts_the_sequences_positions(
    name, base, block_size, explicit, monkeypatch
):
    if explicit:  # the masked flash call refused: the explicit path, queries in chunks of ~8
        monkeypatch.setattr(prefill, "_MASKED_PREFILL_MAX", 0)
        monkeypatch.setattr(prefill, "_PREFILL_SCORE_BUDGET", 8 * 8 * 45)
    run(name, block_size, base, None, 9, mass=explicit)


@pytest.mark.parametrize("explicit", [False, True], ids=["flash", "explicit"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", [*MASKED, "softcap"])
def test_queries_past_every_key_see_what_their_window_leaves(name, block_size, explicit, monkeypatch):
    if explicit:
        monkeypatch.setattr(prefill, "_MASKED_PREFILL_MAX", 0)
        monkeypatch.setattr(prefill, "_PREFILL_SCORE_BUDGET", 8 * 8 * 45)
    spec = SPECS[name]
    base = 32  # the extent holds positions 32 .. 76; queries from 77 (right after it) on
    n = 0
    while n < 12 and spec.first_visible(base + 45 + n) < base + 45:  # each query must see a key
        n += 1
    if n == 0:  # a window of 1 sees only the query's own token: never an earlier extent
        assert name == "window1"
        return
    run(name, block_size, base, 45, n, mass=explicit)
    if spec.first_visible(base + 50) < base + 45:  # a gap: queries well past the extent
        run(name, block_size, base, 50, 1, mass=False)


def test_a_later_extent_releases_blocks_by_the_sequences_positions():
    layers = (LayerAttention(window=6), LayerAttention(chunk=6))
    at0 = SequenceSpec.of(layers, 4)
    at8 = SequenceSpec.of(layers, 4, first_position=8)
    assert at0.release_step == 3  # chunks of 6 over blocks of 4: whole 12-token steps
    assert at8.release_step == 1  # a later extent's chunk rows run as windows: no alignment needed
    # at local position 13 (sequence position 21): the chunk [18, 24) and the window 16..21 see
    # from 16, i.e. local 8: two of its blocks are dead
    assert at8.releasable(13, 4) == 2
    assert at0.releasable(13, 4) == 0  # from 8 (the window): 2 blocks, rounded down to a step of 3
    assert SequenceSpec.of(layers, 4, first_position=40).releasable(0, 4) == 0


def test_first_position_is_checked():
    from engine_helpers import make_engine

    engine = make_engine()
    layers = [LayerAttention(window=4)] * engine.spec.num_layers
    with pytest.raises(InvalidArgument, match="not a multiple of block_size"):
        engine.open("s", [], attention=layers, first_position=engine.spec.block_size + 1)
    with pytest.raises(InvalidArgument, match="first_position must be an int >= 0"):
        engine.open("s", [], attention=layers, first_position=-4)
    assert "s" not in engine.manager.seqs
