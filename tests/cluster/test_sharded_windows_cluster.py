"""A windowed sequence that outgrows its node's pool, on a real cluster (issue 20): redis-server,
a coordinator and three `pagedkv node` processes, a cluster secret and a tenant's token. Layer 0
slides over 30 tokens, layer 1 attends in chunks of 20: more than a 6-block pool of 4-token
blocks holds, so the node refuses the next block and the client spills, the new extent's node
counting the sequence's positions; decoding stays exact (float64 dense attention under the same
masks), the first extent stops being attended once the window has left it, and close frees
every node."""

from __future__ import annotations

import math
import time

import torch
from conftest import TOKENS, tenants_file

from pagedkv.client import CacheClient, LayerAttention
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.protos.spec import ModelSpec

NODE = NodeOptions(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=6, host_blocks=8)
SPEC = ModelSpec(2, 2, 16, "float32", 4)
LAYERS = (LayerAttention(window=30), LayerAttention(chunk=20))
Q_HEADS = 4


def dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hq, D] at the last of the keys k, v [L, Hk, D] under `layer`'s mask, float64."""
    k, v = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) / math.sqrt(q.shape[-1])
    first = layer.first_visible(k.shape[0] - 1)
    scores[:, :first] = -math.inf
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v), scores.logsumexp(-1)


def test_a_windowed_sequence_spills_and_keeps_decoding_exactly(tmp_path, redis_url):
    cluster = LocalCluster(
        3, NODE, redis_url=redis_url, log_dir=str(tmp_path), tenants_file=tenants_file(tmp_path)
    )
    with (
        cluster,
        CacheClient(coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=SPEC) as client,
    ):
        g = torch.Generator().manual_seed(1)
        k_all = torch.randn(2, 20, 2, 16, generator=g)
        v_all = torch.randn(2, 20, 2, 16, generator=g)
        seq = client.open("windowed", [1], attention=LAYERS)
        seq.append(list(range(20)), k_all, v_all)  # 5 blocks of a 6-block pool
        for step in range(50):
            k, v = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
            k_all, v_all = torch.cat([k_all, k], 1), torch.cat([v_all, v], 1)
            for layer in range(2):
                q = torch.randn(Q_HEADS, 16, generator=g)
                res = seq.attend(layer, q, k[layer, 0], v[layer, 0], step if layer == 0 else None)
                out, lse = dense(q, k_all[layer], v_all[layer], LAYERS[layer])
                torch.testing.assert_close(res.out.double(), out, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(res.lse.double(), lse, atol=1e-4, rtol=1e-4)
            client.check_integrity()
        assert seq.extents[1].first_token == 24  # the first pool full: the next block elsewhere
        assert len({e.route.node_id for e in seq.extents}) == len(seq.extents) >= 2
        assert client.counters["window_skipped_attends"] > 0  # extent 0 left behind by both layers
        assert client.cluster_stats().counters["spills"] == len(seq.extents) - 1
        seq.close()
        for address in cluster.node_addresses:  # the Frees are asynchronous: wait for them
            for _ in range(100):
                if client.node_stats(address).counters["num_sequences"] == 0:
                    break
                time.sleep(0.05)
            assert client.node_stats(address).counters["num_sequences"] == 0
        client.check_integrity()
