"""A real local cluster (redis-server, coordinator and nodes as processes on
free ports) for the cluster tests, plus a worker-process runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cluster import LocalCluster, NodeOptions

HERE = Path(__file__).parent
TOKENS = {"alpha": "token-alpha", "beta": "token-beta"}


def tenants_file(tmp_path: Path, quotas: dict[str, int] | None = None) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tokens": {v: k for k, v in TOKENS.items()}, "quotas": quotas or {}}))
    return str(path)


def make_cluster(tmp_path: Path, redis_url: str = "", num_nodes: int = 2, **kw) -> LocalCluster:
    node = NodeOptions(
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        dtype="float32",
        block_size=16,
        num_blocks=256,
        host_blocks=64,
    )
    return LocalCluster(
        num_nodes,
        node,
        redis_url=redis_url,
        lease_ttl_s=kw.pop("lease_ttl_s", 3.0),
        log_dir=str(tmp_path),
        tenants_file=tenants_file(tmp_path, kw.pop("quotas", None)),
        **kw,
    )


def run_worker(cluster: LocalCluster, seq_id: str, prompt: list[int], tenant="alpha", keep=False) -> dict:
    args = [
        sys.executable,
        str(HERE / "worker.py"),
        cluster.coordinator_address,
        seq_id,
        TOKENS[tenant],
        json.dumps(prompt),
    ] + (["--keep"] if keep else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the non-destructive tests, on the session's redis-server."""
    tmp = tmp_path_factory.mktemp("cluster")
    with make_cluster(tmp, use_redis=True) as c:
        yield c
