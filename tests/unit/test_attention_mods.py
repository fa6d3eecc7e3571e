"""Score modifiers (AttentionSpec: window, chunks, soft-cap, sinks, scale) on the CPU paths of
paged_decode and paged_prefill, against a float64 dense reference written from the definitions
in attention_spec.py, on test_attention's NaN-poisoned pools with shuffled tables and a fork.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import LSE_TOL, MASS_TOL, OUT_TOL, make_scenario

from pagedkv.cache_node import attention
from pagedkv.cache_node.attention import (
    AttentionSpec,
    cpu_kernel,
    merge_partials,
    paged_decode,
    paged_prefill,
    prefill,
)
from pagedkv.cache_node.attention.spec import PLAIN, apply_sinks, dead_prefix_blocks
from pagedkv.protos.errors import InvalidArgument

BACKENDS = ["kernel", "torch"]
HEAD_DIM = 32


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


def _require(backend: str) -> None:
    if backend == "kernel" and not attention.kernel_info().is_available:
        pytest.skip(f"C++ kernel unavailable: {attention.kernel_info().detail}")


def dense(q, keys, values, query_pos, spec: AttentionSpec, key_pos=None, with_sinks: bool = True):
    """Float64: q [n, Hq, D] at query_pos [n] over keys [L, Hk, D] at key_pos (default 0..L-1).
    Returns out [n, Hq, D], lse [n, Hq] and the mass per key [L] summed over heads and queries."""
    group = q.shape[1] // keys.shape[1]
    k64 = keys.double().repeat_interleave(group, dim=1)
    v64 = values.double().repeat_interleave(group, dim=1)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k64) * scale
    if spec.softcap:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    kp = torch.arange(keys.shape[0]) if key_pos is None else key_pos
    qp = query_pos.unsqueeze(1)
    hidden = kp.unsqueeze(0) > qp
    if spec.window:
        hidden |= kp.unsqueeze(0) <= qp - spec.window
    if spec.chunk:
        hidden |= kp.unsqueeze(0) // spec.chunk != qp // spec.chunk
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    if spec.sinks is not None and with_sinks:
        lse = torch.logaddexp(lse, torch.tensor(spec.sinks, dtype=torch.float64).unsqueeze(1))
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a part with no key: all 0
    out = torch.einsum("hnl,lhd->nhd", probs, v64)
    return out, lse.T, probs.sum(dim=(0, 1))


def per_block(mass_per_key: torch.Tensor, block_size: int) -> torch.Tensor:
    n = -(-mass_per_key.shape[0] // block_size)
    padded = torch.zeros(n * block_size, dtype=torch.float64)
    padded[: mass_per_key.shape[0]] = mass_per_key
    return padded.view(n, block_size).sum(-1)


SPECS = {
    "window1": AttentionSpec(window=1),
    "window5": AttentionSpec(window=5),
    "window16": AttentionSpec(window=16),  # a block exactly (bs 16)
    "window17": AttentionSpec(window=17),  # across a block boundary
    "window_long": AttentionSpec(window=1000),  # larger than every sequence
    "chunk4": AttentionSpec(chunk=4),
    "chunk16": AttentionSpec(chunk=16),
    "softcap": AttentionSpec(softcap=2.0),
    "sinks": AttentionSpec(sinks=(-1.0, 0.0, 0.5, 2.0, 1.0, -3.0, 0.25, 4.0)),
    "scale": AttentionSpec(scale=0.4),
    "window_softcap_sinks": AttentionSpec(window=7, softcap=3.0, sinks=(0.5,) * 8, scale=0.3),
    "chunk_sinks": AttentionSpec(chunk=8, sinks=tuple(float(i) / 4 for i in range(8))),
    "window_chunk": AttentionSpec(window=6, chunk=16),
}


def _poison_before_window(sc, spec: AttentionSpec, block_size: int) -> torch.Tensor:
    """A copy of the tables with every block wholly before a sequence's window set to -1 (what a
    released block would leave): the backends must not read it."""
    tables = sc.tables.clone()
    for b, n in enumerate(sc.seq_lens.tolist()):
        tables[b, : spec.first_visible(n - 1) // block_size] = -1
    return tables


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_decode_mods_match_reference(backend: str, block_size: int, group: int, name: str) -> None:
    _require(backend)
    spec = SPECS[name]
    num_kv_heads = 8 // group
    lens = [1, 5, 16, 17, 33, 70, 70]
    sc = make_scenario(
        lens,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=HEAD_DIM,
        fork_of_first=1,
        seed=block_size + group,
    )
    sc.seq_lens = torch.tensor(lens)
    tables = _poison_before_window(sc, spec, block_size)
    q = torch.randn(len(lens), 8, HEAD_DIM)
    res = paged_decode(
        q, sc.k_cache, sc.v_cache, tables, sc.seq_lens, return_block_mass=True, backend=backend, spec=spec
    )
    assert res.block_mass is not None
    for b, n in enumerate(lens):
        out, lse, mass = dense(q[b : b + 1], sc.keys[b], sc.values[b], torch.tensor([n - 1]), spec)
        torch.testing.assert_close(res.out[b].double(), out[0], **OUT_TOL[torch.float32])
        torch.testing.assert_close(res.lse[b].double(), lse[0], **LSE_TOL)
        want = per_block(mass, block_size)
        torch.testing.assert_close(res.block_mass[b, : len(want)].double(), want, **MASS_TOL)
        # masked blocks (before the window, other chunks) get exactly no mass
        assert torch.all(res.block_mass[b, : len(want)][want == 0] == 0)
        assert torch.all(res.block_mass[b, len(want) :] == 0)


@pytest.mark.parametrize("num_partitions", [2, 5])
def test_kernel_split_counts_sinks_once(num_partitions: int) -> None:
    """The kernel's flash-decoding split with a window and sinks: the sink joins one partition."""
    _require("kernel")
    spec = AttentionSpec(window=37, softcap=4.0, sinks=(1.0, -1.0, 3.0, 0.0))
    lens = [90, 200]
    sc = make_scenario(lens, num_kv_heads=2, block_size=8, head_dim=HEAD_DIM, seed=9)
    tables = _poison_before_window(sc, spec, 8)
    q = torch.randn(2, 4, HEAD_DIM)
    res = cpu_kernel.decode(
        q, sc.k_cache, sc.v_cache, tables, sc.seq_lens, 0.25, True, num_partitions=num_partitions, spec=spec
    )
    spec_scaled = AttentionSpec(scale=0.25, window=37, softcap=4.0, sinks=spec.sinks)
    for b, n in enumerate(lens):
        out, lse, _ = dense(q[b : b + 1], sc.keys[b], sc.values[b], torch.tensor([n - 1]), spec_scaled)
        torch.testing.assert_close(res.out[b].double(), out[0], **OUT_TOL[torch.float32])
        torch.testing.assert_close(res.lse[b].double(), lse[0], **LSE_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_mods_half_types(backend: str, dtype: torch.dtype) -> None:
    _require(backend)
    spec = SPECS["window_softcap_sinks"]
    lens = [9, 40]
    sc = make_scenario(lens, num_kv_heads=2, block_size=8, head_dim=HEAD_DIM, dtype=dtype, seed=5)
    q = torch.randn(2, 8, HEAD_DIM).to(dtype)
    res = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend=backend, spec=spec)
    for b, n in enumerate(lens):
        out, lse, _ = dense(q[b : b + 1], sc.keys[b], sc.values[b], torch.tensor([n - 1]), spec)
        torch.testing.assert_close(res.out[b].double(), out[0], **OUT_TOL[dtype])
        torch.testing.assert_close(res.lse[b].double(), lse[0], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("with_mass", [False, True])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("num_queries", [1, 9, 45])
def test_prefill_mods_match_reference(block_size: int, with_mass: bool, name: str, num_queries: int) -> None:
    spec = SPECS[name]
    context_len = 45
    sc = make_scenario([context_len], num_kv_heads=2, block_size=block_size, head_dim=HEAD_DIM, seed=7)
    table = sc.tables[0].clone()
    table[: spec.first_visible(context_len - num_queries) // block_size] = -1  # never read
    q = torch.randn(num_queries, 8, HEAD_DIM)
    res = paged_prefill(q, sc.k_cache, sc.v_cache, table, context_len, return_block_mass=with_mass, spec=spec)
    query_pos = torch.arange(context_len - num_queries, context_len)
    out, lse, mass = dense(q, sc.keys[0], sc.values[0], query_pos, spec)
    torch.testing.assert_close(res.out.double(), out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(res.lse.double(), lse, **LSE_TOL)
    if with_mass:
        assert res.block_mass is not None
        want = per_block(mass, block_size)
        torch.testing.assert_close(res.block_mass[: len(want)].double(), want, **MASS_TOL)
        assert torch.all(res.block_mass[: len(want)][want == 0] == 0)
    else:
        assert res.block_mass is None


@pytest.mark.parametrize("name", ["window17", "chunk16", "window_softcap_sinks"])
def test_prefill_mods_large_and_chunked_scores(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill whose mask is too large for one flash call and whose scores come in query chunks."""
    monkeypatch.setattr(prefill, "_MASKED_PREFILL_MAX", 64)
    monkeypatch.setattr(prefill, "_PREFILL_SCORE_BUDGET", 8 * 8 * 50)  # ~8 queries a chunk
    spec = SPECS[name]
    sc = make_scenario([50], num_kv_heads=2, block_size=4, head_dim=HEAD_DIM, seed=8)
    q = torch.randn(30, 8, HEAD_DIM)
    for with_mass in (False, True):
        table = sc.tables[0]
        res = paged_prefill(q, sc.k_cache, sc.v_cache, table, 50, return_block_mass=with_mass, spec=spec)
        out, lse, _ = dense(q, sc.keys[0], sc.values[0], torch.arange(20, 50), spec)
        torch.testing.assert_close(res.out.double(), out, **OUT_TOL[torch.float32])
        torch.testing.assert_close(res.lse.double(), lse, **LSE_TOL)


def test_prefill_batch_of_sequences_with_mods() -> None:
    """The batch prefill is one paged_prefill per sequence (engine.attend_prefill_batch): a forked
    pair sharing blocks and a third, each with its own length, under one spec."""
    spec = SPECS["window_softcap_sinks"]
    lens = [40, 23, 40]
    sc = make_scenario(lens, num_kv_heads=4, block_size=16, head_dim=HEAD_DIM, fork_of_first=1, seed=11)
    for b, (n, nq) in enumerate(zip(lens, [12, 23, 3], strict=True)):
        q = torch.randn(nq, 8, HEAD_DIM)
        res = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[b], n, spec=spec)
        out, lse, _ = dense(q, sc.keys[b], sc.values[b], torch.arange(n - nq, n), spec)
        torch.testing.assert_close(res.out.double(), out, **OUT_TOL[torch.float32])
        torch.testing.assert_close(res.lse.double(), lse, **LSE_TOL)


# --------------------------------------------------------------------------- merging partials


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("split", [1, 30, 64])
def test_two_way_merge_with_mods(name: str, split: int) -> None:
    """The node's result over a whole sequence equals the merge of two extents' partials [0, split)
    and [split, L) under the documented sink rule: the sinks counted in exactly one part, or in
    none and folded in once after the merge (apply_sinks)."""
    spec = SPECS[name]
    n = 70
    sc = make_scenario([n], num_kv_heads=2, block_size=16, head_dim=HEAD_DIM, seed=13)
    q = torch.randn(1, 8, HEAD_DIM)
    node = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, spec=spec, backend="torch")
    qp = torch.tensor([n - 1])
    keys, values = sc.keys[0], sc.values[0]
    a_pos, b_pos = torch.arange(split), torch.arange(split, n)
    out_a, lse_a, _ = dense(q, keys[:split], values[:split], qp, spec, key_pos=a_pos, with_sinks=False)
    out_b, lse_b, _ = dense(q, keys[split:], values[split:], qp, spec, key_pos=b_pos, with_sinks=True)
    out, lse = merge_partials([out_a.float(), out_b.float()], [lse_a.float(), lse_b.float()])
    torch.testing.assert_close(out[0], node.out[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse[0], node.lse[0], **LSE_TOL)
    _, lse_b0, _ = dense(q, keys[split:], values[split:], qp, spec, key_pos=b_pos, with_sinks=False)
    out_b0, _, _ = dense(q, keys[split:], values[split:], qp, spec, key_pos=b_pos, with_sinks=False)
    out, lse = merge_partials([out_a.float(), out_b0.float()], [lse_a.float(), lse_b0.float()])
    if spec.sinks is not None:
        out, lse = apply_sinks(out, lse, torch.tensor(spec.sinks))
    torch.testing.assert_close(out[0], node.out[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse[0], node.lse[0], **LSE_TOL)


def test_sinks_counted_twice_is_wrong() -> None:
    """Why the rule matters: merging two parts that both carry the sinks is not the whole."""
    spec = SPECS["sinks"]
    sc = make_scenario([40], num_kv_heads=2, block_size=16, head_dim=HEAD_DIM, seed=14)
    q = torch.randn(1, 8, HEAD_DIM)
    whole = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, spec=spec, backend="torch")
    qp, keys, values = torch.tensor([39]), sc.keys[0], sc.values[0]
    a = dense(q, keys[:20], values[:20], qp, spec)
    b = dense(q, keys[20:], values[20:], qp, spec, key_pos=torch.arange(20, 40))
    _, lse = merge_partials([a[0].float(), b[0].float()], [a[1].float(), b[1].float()])
    assert not torch.allclose(lse[0], whole.lse[0], atol=1e-3)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window=-1),
        dict(chunk=1.5),
        dict(window=True),
        dict(softcap=-1.0),
        dict(softcap=math.inf),
        dict(scale=0.0),
        dict(scale=math.nan),
        dict(sinks=()),
        dict(sinks=(1.0, math.nan)),
        dict(sinks="ab"),
    ],
)
def test_spec_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument, match="attention spec"):
        AttentionSpec(**kwargs)


def test_spec_checked_against_the_call() -> None:
    sc = make_scenario([10], num_kv_heads=2, block_size=4, head_dim=HEAD_DIM, seed=1)
    q = torch.randn(1, 4, HEAD_DIM)
    args = (q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens)
    with pytest.raises(InvalidArgument, match="3 sinks for 4 query heads"):
        paged_decode(*args, spec=AttentionSpec(sinks=(0.0, 1.0, 2.0)))
    with pytest.raises(InvalidArgument, match="contradicts"):
        paged_decode(*args, scale=0.5, spec=AttentionSpec(scale=0.25))
    with pytest.raises(InvalidArgument, match="spec must be an AttentionSpec"):
        paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], 10, spec={"window": 4})  # type: ignore[arg-type]
    # the same scale twice is fine; a block inside the window that is bad is still named
    paged_decode(*args, scale=0.25, spec=AttentionSpec(scale=0.25))
    bad = sc.tables.clone()
    bad[0, 2] = 99
    with pytest.raises(InvalidArgument, match="not a physical block id"):
        paged_decode(q, sc.k_cache, sc.v_cache, bad, sc.seq_lens, spec=AttentionSpec(window=3))


# --------------------------------------------------------------------------- releasable blocks


def test_dead_prefix_blocks_follow_every_layers_window() -> None:
    w8, w20, c16 = AttentionSpec(window=8), AttentionSpec(window=20), AttentionSpec(chunk=16)
    # the query at 8 sees 1..8 with window 8: block 0 of size 1 is dead, of size 4 not
    assert dead_prefix_blocks([w8], 8, 1) == 1
    assert dead_prefix_blocks([w8], 8, 4) == 0
    assert dead_prefix_blocks([w8], 11, 4) == 1  # sees 4..11
    assert dead_prefix_blocks([w8, w20], 30, 4) == 2  # the widest window rules: sees 11..30
    assert dead_prefix_blocks([w8, PLAIN], 1000, 4) == 0  # a full layer keeps everything
    assert dead_prefix_blocks([c16], 31, 4) == 4 and dead_prefix_blocks([c16], 32, 4) == 8
    assert dead_prefix_blocks([], 50, 4) == 0
    # a block counted dead is never visible to a later query of any layer (the release is safe)
    specs = [w8, AttentionSpec(window=13, chunk=32)]
    dead = [dead_prefix_blocks(specs, p, 4) for p in range(200)]
    assert dead == sorted(dead) and dead[-1] > 0
    for p, n in enumerate(dead):
        for later in range(p, 200):
            assert all(spec.first_visible(later) >= n * 4 for spec in specs)
    with pytest.raises(InvalidArgument, match="block_size"):
        dead_prefix_blocks([w8], 10, 0)
    with pytest.raises(InvalidArgument, match="next_pos"):
        dead_prefix_blocks([w8], -1, 4)
