"""`pagedkv node --model-id`: the node registers its model, the coordinator places a worker's
opens only on nodes of the worker's model, and one naming another model (or none) is told which
models are served."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import TOKENS, tenants_file

from pagedkv.client.sync import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.protos.errors import Unavailable
from pagedkv.protos.spec import ModelSpec

NODE = NodeOptions(
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype="float32",
    block_size=16,
    num_blocks=64,
    model_id="org/tuned@1",
)


def test_a_named_node_serves_its_model_only(tmp_path, redis_url) -> None:
    cluster = LocalCluster(
        1, NODE, redis_url=redis_url, log_dir=str(tmp_path), tenants_file=tenants_file(tmp_path)
    )
    named = ModelSpec(**NODE.spec())
    with cluster:
        with CacheClient(
            coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=named
        ) as client:
            assert [n.spec for n in client.cluster_stats().nodes] == [named]
            seq = client.open("s", list(range(20)))
            assert seq.extents[0].route.node_id == client.cluster_stats().nodes[0].node_id
            seq.close()
        for other in (replace(named, model="org/base@1"), replace(named, model="")):
            with (
                CacheClient(
                    coordinator=cluster.coordinator_address, token=TOKENS["alpha"], spec=other
                ) as client,
                pytest.raises(Unavailable, match=r"live nodes serve \[\{[^]]*'model': 'org/tuned@1'"),
            ):
                client.open("s2", list(range(20)))
