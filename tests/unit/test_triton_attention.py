"""The Triton paged-attention kernels against the float64 reference of test_attention.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (slow, exact: the
shapes are kept small); with one, the same tests run the compiled kernels on the device. The
scenarios are test_attention's: NaN-poisoned pools, shuffled block tables, a forked sequence
sharing its parent's full blocks, lengths on and across block boundaries.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import LSE_TOL, MASS_TOL, OUT_TOL, check_decode, make_scenario, reference

# Imported before anything else imports triton: it picks the interpreter when there is no CUDA.
from pagedkv.cache_node import attention
from pagedkv.cache_node.attention import backends, paged_decode, paged_prefill
from pagedkv.cache_node.attention import decode as decode_module
from pagedkv.cache_node.attention import triton_backend as triton_attention
from pagedkv.cache_node.eviction import ScorePolicy
from pagedkv.protos.errors import InvalidArgument

if not triton_attention.IS_AVAILABLE:
    pytest.skip("triton is not installed (pip install -e '.[gpu]')", allow_module_level=True)
if not torch.cuda.is_available() and not triton_attention.IS_INTERPRETED:
    pytest.skip("no CUDA device and triton was imported outside interpreter mode", allow_module_level=True)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not triton_attention.IS_INTERPRETED else "cpu")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # the queries: every run checks the same values


def on_device(sc):  # type: ignore[no-untyped-def]
    sc.k_cache, sc.v_cache = sc.k_cache.to(DEVICE), sc.v_cache.to(DEVICE)
    sc.tables, sc.seq_lens = sc.tables.to(DEVICE), sc.seq_lens.to(DEVICE)
    return sc


def decode(q, sc, *, num_splits: int | None, scale: float | None = None):  # type: ignore[no-untyped-def]
    """paged_decode's checks, then the triton path with a forced number of key splits."""
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    res = decode_module.decode_triton(
        q.to(DEVICE),
        sc.k_cache,
        sc.v_cache,
        sc.tables,
        sc.seq_lens,
        int(sc.seq_lens.max()),
        scale,
        True,
        num_splits=num_splits,
    )
    return attention.AttentionOutput(
        res.out.cpu(), res.lse.cpu(), None if res.block_mass is None else res.block_mass.cpu()
    )


def to_cpu(sc):  # type: ignore[no-untyped-def]
    sc.tables, sc.seq_lens = sc.tables.cpu(), sc.seq_lens.cpu()
    return sc


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_reference(group: int, block_size: int, num_splits: int) -> None:
    bs = block_size
    lens = [1, bs, bs + 1, 2 * bs - 1 if bs > 1 else 2, 3 * bs, 37, 53]
    sc = on_device(
        make_scenario(lens, num_kv_heads=2, block_size=bs, head_dim=64, fork_of_first=1, seed=bs + group)
    )
    q = torch.randn(len(lens), 2 * group, 64)
    result = decode(q, sc, num_splits=num_splits)
    check_decode(result, to_cpu(sc), q, 64**-0.5, bs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_half_types(dtype: torch.dtype, num_splits: int) -> None:
    lens = [5, 16, 40, 70]
    sc = on_device(
        make_scenario(lens, num_kv_heads=2, block_size=8, head_dim=64, dtype=dtype, fork_of_first=1, seed=3)
    )
    q = torch.randn(len(lens), 8, 64).to(dtype)
    result = decode(q, sc, num_splits=num_splits)
    check_decode(result, to_cpu(sc), q, 64**-0.5, 8)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "group"),
    [(80, 5, 2), (128, 128, 8), (256, 16, 1), (96, 3, 3)],  # padded dims, odd blocks, odd groups
)
def test_decode_head_dims_block_sizes_and_scale(head_dim: int, block_size: int, group: int) -> None:
    lens = [3, block_size + 2, 150]
    sc = on_device(
        make_scenario(lens, num_kv_heads=1, block_size=block_size, head_dim=head_dim, seed=head_dim)
    )
    q = torch.randn(len(lens), group, head_dim)
    result = decode(q, sc, num_splits=2, scale=0.3)
    check_decode(result, to_cpu(sc), q, 0.3, block_size)


def test_more_splits_than_keys_leaves_empty_splits_out() -> None:
    """One short and one long sequence with many splits: the short one's later splits hold no
    key (lse -inf) and must get no weight in the merge."""
    sc = on_device(make_scenario([2, 300], num_kv_heads=1, block_size=4, head_dim=32, seed=7))
    q = torch.randn(2, 4, 32)
    check_decode(decode(q, sc, num_splits=5), to_cpu(sc), q, 32**-0.5, 4)


def test_public_decode_backend_agrees_with_torch_and_writes_out() -> None:
    sc = on_device(make_scenario([9, 70, 33], num_kv_heads=2, block_size=4, head_dim=32, seed=5))
    q = torch.randn(3, 8, 32, device=DEVICE)
    dst = (torch.full((3, 8, 32), math.nan), torch.full((3, 8), math.nan))
    tri = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="triton", return_block_mass=True, out=dst
    )
    ref = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="torch", return_block_mass=True
    )
    assert tri.out is dst[0] and tri.lse is dst[1]
    torch.testing.assert_close(tri.out, ref.out.cpu(), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(tri.lse, ref.lse.cpu(), **LSE_TOL)
    assert tri.block_mass is not None and ref.block_mass is not None
    torch.testing.assert_close(tri.block_mass, ref.block_mass, **MASS_TOL)


def test_decode_rejects_an_out_of_range_block_id() -> None:
    sc = on_device(make_scenario([9, 20], num_kv_heads=1, block_size=4, head_dim=16, seed=1))
    sc.tables[1, 2] = sc.k_cache.shape[0]
    with pytest.raises(InvalidArgument, match=r"block_tables\[1, 2\] = .* not a physical block id"):
        paged_decode(
            torch.randn(2, 2, 16, device=DEVICE),
            sc.k_cache,
            sc.v_cache,
            sc.tables,
            sc.seq_lens,
            backend="triton",
        )


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("context_len", "num_queries"), [(1, 1), (37, 37), (37, 9), (100, 70)])
def test_prefill_matches_reference(group: int, block_size: int, context_len: int, num_queries: int) -> None:
    sc = on_device(
        make_scenario(
            [context_len], num_kv_heads=2, block_size=block_size, head_dim=32, seed=context_len + num_queries
        )
    )
    q = torch.randn(num_queries, 2 * group, 32)
    result = paged_prefill(
        q.to(DEVICE),
        sc.k_cache,
        sc.v_cache,
        sc.tables[0],
        context_len,
        return_block_mass=True,
        backend="triton",
    )
    out, lse, mass = reference(q, sc.keys[0], sc.values[0], context_len - num_queries, 32**-0.5, block_size)
    torch.testing.assert_close(result.out.cpu().double(), out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(result.lse.cpu().double(), lse, **LSE_TOL)
    assert result.block_mass is not None and result.block_mass.shape == (sc.tables.shape[1],)
    block_mass = result.block_mass.cpu()
    torch.testing.assert_close(block_mass[: len(mass)].double(), mass, **MASS_TOL)
    assert torch.all(block_mass[len(mass) :] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_types(dtype: torch.dtype) -> None:
    sc = on_device(make_scenario([45], num_kv_heads=1, block_size=8, head_dim=64, dtype=dtype, seed=3))
    q = torch.randn(20, 4, 64).to(dtype)
    result = paged_prefill(q.to(DEVICE), sc.k_cache, sc.v_cache, sc.tables[0], 45, backend="triton")
    out, lse, _ = reference(q, sc.keys[0], sc.values[0], 25, 64**-0.5, 8)
    assert result.out.dtype == dtype and result.block_mass is None
    torch.testing.assert_close(result.out.cpu().double(), out, **OUT_TOL[dtype])
    torch.testing.assert_close(result.lse.cpu().double(), lse, **LSE_TOL)


def test_prefill_of_last_token_equals_decode() -> None:
    sc = on_device(make_scenario([29], num_kv_heads=2, block_size=8, head_dim=32, seed=9))
    q = torch.randn(1, 8, 32, device=DEVICE)
    pre = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], 29, return_block_mass=True, backend="triton")
    dec = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend="triton"
    )
    torch.testing.assert_close(pre.out, dec.out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(pre.lse, dec.lse, **LSE_TOL)
    assert pre.block_mass is not None and dec.block_mass is not None
    torch.testing.assert_close(pre.block_mass, dec.block_mass[0], **MASS_TOL)


# --------------------------------------------------------------------------- backend choice


def test_backend_choice() -> None:
    """auto: triton on CUDA tensors (compiled), the C++ kernel or torch on CPU; forcing triton on
    CPU tensors is only possible in the interpreter."""
    cpu = torch.device("cpu")
    assert backends.pick_backend("auto", cpu) in ("kernel", "torch")
    if triton_attention.IS_INTERPRETED:
        assert backends.pick_backend("triton", cpu) == "triton"
    else:
        assert backends.pick_backend("auto", torch.device("cuda")) == "triton"
        with pytest.raises(InvalidArgument, match="TRITON_INTERPRET"):
            backends.pick_backend("triton", cpu)
    with pytest.raises(InvalidArgument, match="'auto', 'kernel', 'triton' or 'torch'"):
        backends.pick_backend("flash", cpu)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- through the engine


def _run_engine_steps(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A prefill, a fork and decode steps (appending K/V layer by layer) on a score-policy engine;
    returns every attention output and the attention mass the policy credited to each block."""
    from engine_helpers import Q_HEADS, SPEC, fill, kv_for

    from pagedkv.cache_node.engine import CacheEngine, EngineConfig

    monkeypatch.setenv(attention.BACKEND_ENV, backend)
    engine = CacheEngine(EngineConfig(SPEC, 24, 8, "score", device=str(DEVICE)))
    gen = torch.Generator().manual_seed(0)
    outs: list[torch.Tensor] = []
    fill(engine, "a", list(range(13)), seed=1)
    q = torch.randn(5, Q_HEADS, SPEC.head_dim, generator=gen)
    k, v = kv_for(5, seed=2)
    for layer in range(SPEC.num_layers):
        res = engine.attend_prefill(
            "a", layer, q, k[layer], v[layer], list(range(13, 18)) if layer == 0 else None
        )
        outs += [res.out.cpu(), res.lse.cpu()]
    engine.fork("a", "b")
    for step in range(6):  # crosses a block boundary; "b" copies the shared partial block on write
        q = torch.randn(2, Q_HEADS, SPEC.head_dim, generator=gen)
        k, v = kv_for(2, seed=10 + step)
        for layer in range(SPEC.num_layers):
            tokens = [100 + step, 200 + step] if layer == 0 else None
            res = engine.attend_decode(["a", "b"], layer, q, k[layer], v[layer], tokens)
            outs += [res.out.cpu(), res.lse.cpu()]
    engine.check_integrity()
    policy = engine.manager.device.policy
    assert isinstance(policy, ScorePolicy)
    return outs, torch.from_numpy(policy.mass.copy())


def test_engine_decode_and_prefill_through_triton_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    tri_outs, tri_mass = _run_engine_steps(monkeypatch, "triton")
    ref_outs, ref_mass = _run_engine_steps(monkeypatch, "torch")
    for got, want in zip(tri_outs, ref_outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert float(ref_mass.sum()) > 0
    torch.testing.assert_close(tri_mass, ref_mass, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- score modifications


def reference_mods(q, keys, values, first_pos: int, scale: float, mods: triton_attention.ScoreMods):
    """Float64 attention with a window, chunks, soft-cap and sinks: (out, lse, mass per key)."""
    group = q.shape[1] // keys.shape[1]
    k64 = keys.double().repeat_interleave(group, dim=1)
    v64 = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k64) * scale
    if mods.softcap:
        scores = mods.softcap * torch.tanh(scores / mods.softcap)
    query_pos = (first_pos + torch.arange(q.shape[0])).unsqueeze(1)
    key_pos = torch.arange(keys.shape[0]).unsqueeze(0)
    hidden = key_pos > query_pos
    if mods.window:
        hidden |= key_pos <= query_pos - mods.window
    if mods.chunk:
        hidden |= key_pos // mods.chunk != query_pos // mods.chunk
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [h, n]
    if mods.sinks is not None:
        lse = torch.logaddexp(lse, mods.sinks.double().unsqueeze(1))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.einsum("hnl,lhd->nhd", probs, v64), lse.T, probs.sum(dim=(0, 1))


MODS = {
    "window": dict(window=7),
    "chunk": dict(chunk=8),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=11, chunk=16, softcap=3.0, sinks=True),
}


def _mods(name: str, num_q_heads: int) -> triton_attention.ScoreMods:
    kw: dict = dict(MODS[name])
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1.0, 2.0, num_q_heads)
    return triton_attention.ScoreMods(**kw)


@pytest.mark.parametrize("name", list(MODS))
@pytest.mark.parametrize(("num_queries", "num_splits"), [(1, 1), (1, 3), (20, 1)])  # decode, split, prefill
def test_score_mods_match_reference(name: str, num_queries: int, num_splits: int) -> None:
    """The window, chunk, soft-cap and sink hooks the model families need (issue 23), at the
    kernel: decode (one query per sequence, with and without splits) and prefill."""
    lens = [1, 6, 23, 40]
    sc = on_device(make_scenario(lens, num_kv_heads=2, block_size=4, head_dim=32, fork_of_first=1, seed=21))
    num_q = [min(num_queries, n) for n in lens]
    starts = torch.tensor([sum(num_q[:i]) for i in range(len(lens))], dtype=torch.int32)
    q = 3 * torch.randn(sum(num_q), 8, 32)  # large scores, so the soft-cap matters
    mods = _mods(name, 8)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out, lse, key_mass = triton_attention.attend(
        q.to(DEVICE),
        sc.k_cache,
        sc.v_cache,
        sc.tables.to(**i32),
        starts.to(DEVICE),
        torch.tensor(num_q, **i32),
        sc.seq_lens.to(**i32),
        max_q_len=max(num_q),
        max_ctx=max(lens),
        scale=32**-0.5,
        with_mass=True,
        num_splits=num_splits,
        mods=mods,
    )
    assert key_mass is not None
    for b, n in enumerate(lens):
        rows = slice(int(starts[b]), int(starts[b]) + num_q[b])
        want_out, want_lse, want_mass = reference_mods(
            q[rows], sc.keys[b], sc.values[b], n - num_q[b], 32**-0.5, mods
        )
        torch.testing.assert_close(out[rows].cpu().double(), want_out, **OUT_TOL[torch.float32])
        torch.testing.assert_close(lse[rows].cpu().double(), want_lse, **LSE_TOL)
        torch.testing.assert_close(key_mass[b, :n].cpu().double(), want_mass, **MASS_TOL)


def test_split_count_fills_the_device_only_when_programs_are_few() -> None:
    assert triton_attention.num_splits_for(132, 66 * 8, 32768) == 1  # B x Hk programs: 4 per SM already
    assert triton_attention.num_splits_for(132, 8 * 8, 32768) == 9  # about four programs per SM
    assert triton_attention.num_splits_for(132, 1, 32768) == 64  # at most 64 splits
    assert triton_attention.num_splits_for(132, 8, 1024) == 4  # at least 256 keys per split
    assert triton_attention.num_splits_for(132, 8, 300) == 1
    assert triton_attention.default_num_splits(torch.device("cpu"), 1, 32768) == 1
