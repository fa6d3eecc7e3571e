"""AttentionSpec through the public paged_decode / paged_prefill on the Triton kernels, against
test_attention_mods' float64 reference (under Triton's interpreter without CUDA: small shapes)."""

from __future__ import annotations

import pytest
import torch
from attention_reference import LSE_TOL, MASS_TOL, OUT_TOL, make_scenario
from test_attention_mods import HEAD_DIM, SPECS, _poison_before_window, dense, per_block

from pagedkv.cache_node.attention import paged_decode, paged_prefill

# Imported before anything else imports triton: it picks the interpreter when there is no CUDA.
from pagedkv.cache_node.attention import triton_backend as triton_attention

if not triton_attention.IS_AVAILABLE:
    pytest.skip("triton is not installed (pip install -e '.[gpu]')", allow_module_level=True)
if not torch.cuda.is_available() and not triton_attention.IS_INTERPRETED:
    pytest.skip("no CUDA device and triton was imported outside interpreter mode", allow_module_level=True)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not triton_attention.IS_INTERPRETED else "cpu")


@pytest.mark.parametrize("name", ["window17", "chunk_sinks", "window_softcap_sinks"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_decode_with_spec(name: str, block_size: int) -> None:
    torch.manual_seed(0)
    spec = SPECS[name]
    lens = [3, 40, 40]
    sc = make_scenario(
        lens, num_kv_heads=2, block_size=block_size, head_dim=HEAD_DIM, fork_of_first=1, seed=2
    )
    tables = _poison_before_window(sc, spec, block_size)
    q = torch.randn(len(lens), 8, HEAD_DIM)
    res = paged_decode(
        q.to(DEVICE),
        sc.k_cache.to(DEVICE),
        sc.v_cache.to(DEVICE),
        tables,
        sc.seq_lens,
        return_block_mass=True,
        backend="triton",
        spec=spec,
    )
    assert res.block_mass is not None
    for b, n in enumerate(lens):
        out, lse, mass = dense(q[b : b + 1], sc.keys[b], sc.values[b], torch.tensor([n - 1]), spec)
        torch.testing.assert_close(res.out[b].cpu().double(), out[0], **OUT_TOL[torch.float32])
        torch.testing.assert_close(res.lse[b].cpu().double(), lse[0], **LSE_TOL)
        want = per_block(mass, block_size)
        got = res.block_mass[b, : len(want)].cpu().double()
        torch.testing.assert_close(got, want, **MASS_TOL)
        assert torch.all(got[want == 0] == 0)


@pytest.mark.parametrize("name", ["window5", "window_softcap_sinks"])
def test_triton_prefill_with_spec(name: str) -> None:
    torch.manual_seed(1)
    spec = SPECS[name]
    sc = make_scenario([30], num_kv_heads=2, block_size=4, head_dim=HEAD_DIM, seed=3)
    table = sc.tables[0].clone()
    table[: spec.first_visible(30 - 12) // 4] = -1  # never read
    q = torch.randn(12, 8, HEAD_DIM)
    res = paged_prefill(
        q.to(DEVICE),
        sc.k_cache.to(DEVICE),
        sc.v_cache.to(DEVICE),
        table,
        30,
        return_block_mass=True,
        backend="triton",
        spec=spec,
    )
    out, lse, mass = dense(q, sc.keys[0], sc.values[0], torch.arange(18, 30), spec)
    torch.testing.assert_close(res.out.cpu().double(), out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(res.lse.cpu().double(), lse, **LSE_TOL)
    assert res.block_mass is not None
    torch.testing.assert_close(res.block_mass[:8].cpu().double(), per_block(mass, 4), **MASS_TOL)
