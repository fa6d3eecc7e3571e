"""A sequence that outgrows every node's pool, on a real cluster (issue 20): redis-server, a
coordinator and three `pagedkv node` processes on free ports, with a cluster secret (every data
call carries its ticket) and a tenant's bearer token. No max extent size: each node refuses the
next block and the client spills to another node, then keeps decoding; attention is checked
against float64 dense attention, the KV read back byte-exact, and close frees every node."""

from __future__ import annotations

import math
import time

import torch
from conftest import TOKENS, tenants_file

from pagedkv.client import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.protos.spec import ModelSpec

NODE = NodeOptions(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=6, host_blocks=8)
SPEC = ModelSpec(2, 2, 16, "float32", 4)
Q_HEADS = 4


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hq, D] over every key of k, v [L, Hk, D], float64."""
    k, v = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v), scores.logsumexp(-1)


def test_a_sequence_longer_than_any_node_decodes_across_three(tmp_path, redis_url):
    cluster = LocalCluster(
        3, NODE, redis_url=redis_url, log_dir=str(tmp_path), tenants_file=tenants_file(tmp_path)
    )
    with (
        cluster,
        CacheClient(coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=SPEC) as client,
    ):
        g = torch.Generator().manual_seed(0)
        k_all = torch.randn(2, 20, 2, 16, generator=g)
        v_all = torch.randn(2, 20, 2, 16, generator=g)
        seq = client.open("long", [1])
        seq.append(list(range(20)), k_all, v_all)  # 5 blocks of a 6-block pool
        for step in range(40):  # 60 tokens: 15 blocks over three pools of 6
            k, v = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
            k_all, v_all = torch.cat([k_all, k], 1), torch.cat([v_all, v], 1)
            for layer in range(2):
                q = torch.randn(Q_HEADS, 16, generator=g)
                res = seq.attend(layer, q, k[layer, 0], v[layer, 0], step if layer == 0 else None)
                out, lse = dense(q, k_all[layer], v_all[layer])
                torch.testing.assert_close(res.out.double(), out, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(res.lse.double(), lse, atol=1e-4, rtol=1e-4)
        assert [e.first_token for e in seq.extents] == [0, 24, 48]  # each pool full, then the next
        assert len({e.route.node_id for e in seq.extents}) == 3
        got_k, got_v = seq.read_kv(10, 60)
        assert torch.equal(got_k, k_all[:, 10:60]) and torch.equal(got_v, v_all[:, 10:60])
        client.check_integrity()
        assert client.cluster_stats().counters["spills"] == 2
        seq.close()
        for address in cluster.node_addresses:  # the Frees are asynchronous: wait for them
            for _ in range(100):
                if client.node_stats(address).counters["num_sequences"] == 0:
                    break
                time.sleep(0.05)
            assert client.node_stats(address).counters["num_sequences"] == 0
        client.check_integrity()
