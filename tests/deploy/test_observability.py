"""The metrics beyond the basics, against real servers: the node's host-tier hits, swap bytes
and info; the coordinator's per-tenant opens, hits and quota use, Redis call latency and
errors, suspect nodes and info (a real cluster of processes on redis-server, scraped over
HTTP); every exposition checked by promtool where it is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pagedkv import __version__
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.metrics import NodeMetrics
from pagedkv.cache_node.server import create_server
from pagedkv.client import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.coordinator.core import Coordinator
from pagedkv.coordinator.metrics import CoordinatorMetrics
from pagedkv.coordinator.store import open_store
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # tests/deploy's promtool tests report the skip
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series in an exposition (labels matched as a subset)."""
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"no {name}{labels} in the scrape")


def test_node_host_hits_swap_bytes_and_info() -> None:
    engine = CacheEngine(EngineConfig(SPEC, 4, 8, device="cpu"))  # 4 device blocks, 8 on the host
    metrics = NodeMetrics()
    metrics.describe(
        version=__version__,
        spec=SPEC.to_dict(),
        bytes_per_block=SPEC.bytes_per_block,
        device="cpu",
        policy="lru",
    )
    server, port = create_server(engine, "127.0.0.1:0", metrics=metrics)
    server.start()
    http, _ = metrics.serve(0, "127.0.0.1")
    try:
        a, b = list(range(1, 10)), list(range(100, 116))  # a: 2 full blocks + 1 token; b: 4 blocks
        with CacheClient(f"127.0.0.1:{port}") as client:
            with client.open("a", a) as seq:
                seq.append(a, *kv(len(a), 1))
            with client.open("b", b) as seq:  # takes the whole device pool: a's 2 blocks go to the host
                seq.append(b, *kv(len(b), 2))
            with client.open("a-again", a) as seq:  # a's blocks come back from the host tier
                assert seq.num_cached_tokens == 8
                seq.append(a[8:], *(t[:, 8:] for t in kv(len(a), 1)))
                seq.swap_out()  # 3 blocks out; back in, its keyed blocks may be found still cached
                seq.swap_in()
            stats = client.stats().counters
        text = scrape(f"http://127.0.0.1:{http.server_address[1]}/metrics")
    finally:
        http.shutdown()
        server.stop(0)
    assert stats["prefix_host_hit_tokens"] == 8
    assert sample(text, "pagedkv_prefix_cache_host_hits_tokens_total") == 8
    assert sample(text, "pagedkv_prefix_cache_hits_tokens_total") == stats["prefix_hit_tokens"] >= 8
    assert stats["swap_out_blocks"] == 3 and stats["swap_in_blocks"] >= 1
    assert sample(text, "pagedkv_swap_bytes_total", direction="out") == 3 * SPEC.bytes_per_block
    assert (
        sample(text, "pagedkv_swap_bytes_total", direction="in")
        == stats["swap_in_blocks"] * SPEC.bytes_per_block
    )
    info = dict(
        num_layers="2",
        num_kv_heads="2",
        head_dim="8",
        dtype="float32",
        block_size="4",
        version=__version__,
        device="cpu",
        policy="lru",
    )
    assert sample(text, "pagedkv_node_info", **info) == 1
    promtool_check(text)


def test_coordinator_tenants_redis_suspects_and_info(tmp_path: Path, redis_url: str) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tokens": {"tok-a": "alpha", "tok-b": "beta"}, "quotas": {"alpha": 100}}))
    node = NodeOptions(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4, num_blocks=64, host_blocks=0
    )
    with LocalCluster(
        1, node, redis_url=redis_url, log_dir=str(tmp_path), tenants_file=str(tenants)
    ) as cluster:
        prompt = list(range(1, 14))  # 3 full blocks + 1 token
        with CacheClient(coordinator=cluster.coordinator_address, token="tok-a", spec=SPEC) as client:
            with client.open("a1", prompt) as seq:
                seq.append(prompt, *kv(len(prompt), 1))
            # The node reports a1's blocks to the index asynchronously: wait until it knows them,
            # so a2's open hits 12 of its 13 tokens.
            deadline = time.monotonic() + 10
            while client.lookup(prompt) < 12 and time.monotonic() < deadline:
                time.sleep(0.02)
            with client.open("a2", prompt) as seq:
                cached = seq.num_cached_tokens
                seq.append(prompt[cached:], *(t[:, cached:] for t in kv(len(prompt), 1)))
                held = sample(
                    scrape(f"http://127.0.0.1:{cluster.coordinator_metrics_port}/metrics"),
                    "pagedkv_coordinator_tenant_used_blocks",
                    tenant="alpha",
                )
        text = scrape(f"http://127.0.0.1:{cluster.coordinator_metrics_port}/metrics")
    assert held >= 1  # a2 holds blocks while open (its last block at least)
    assert sample(text, "pagedkv_coordinator_tenant_open_total", tenant="alpha") == 2
    assert sample(text, "pagedkv_coordinator_tenant_prompt_tokens_total", tenant="alpha") == 26
    assert cached == 12
    assert sample(text, "pagedkv_coordinator_tenant_cached_tokens_total", tenant="alpha") == 12
    assert sample(text, "pagedkv_coordinator_tenant_used_blocks", tenant="beta") == 0
    assert sample(text, "pagedkv_coordinator_tenant_quota_blocks", tenant="alpha") == 100
    assert sample(text, "pagedkv_coordinator_redis_latency_seconds_count", op="open_sequence") >= 2
    assert sample(text, "pagedkv_coordinator_nodes_suspect") == 0
    assert sample(text, "pagedkv_coordinator_nodes_reaped_total") == 0
    assert sample(text, "pagedkv_coordinator_reconciled_total", action="ghosts_lost") == 0
    assert sample(text, "pagedkv_coordinator_info", version=__version__, store="redis") == 1
    promtool_check(text)


def test_coordinator_counts_redis_errors_and_leaves_store_gauges_out_when_down(redis_server) -> None:
    redis_server.start()
    redis_server.flushall()  # (the session's server: earlier tests' nodes may have lapsed into suspects)
    store = open_store(redis_server.url)
    coordinator = Coordinator(store)
    metrics = CoordinatorMetrics(coordinator, tenants=["alpha"])
    store.observer = metrics.observe_redis  # type: ignore[attr-defined]
    get = metrics.registry.get_sample_value
    assert get("pagedkv_coordinator_nodes_suspect") == 0
    assert get("pagedkv_coordinator_tenant_used_blocks", {"tenant": "alpha"}) == 0
    redis_server.stop()
    try:
        assert get("pagedkv_coordinator_nodes_suspect") is None  # absent, not a made-up 0
        assert get("pagedkv_coordinator_redis_errors_total", {"op": "expired_nodes"}) >= 1
    finally:
        redis_server.start()
        store.close()


@pytest.mark.parametrize(
    "name",
    [
        "pagedkv_prefix_cache_host_hits_tokens_total",
        "pagedkv_swap_bytes_total",
        "pagedkv_node_info",
        "pagedkv_coordinator_tenant_open_total",
        "pagedkv_coordinator_tenant_cached_tokens_total",
        "pagedkv_coordinator_tenant_used_blocks",
        "pagedkv_coordinator_redis_latency_seconds_bucket",
        "pagedkv_coordinator_redis_errors_total",
        "pagedkv_coordinator_nodes_suspect",
        "pagedkv_coordinator_info",
        "pagedkv_coordinator_nodes_reaped_total",
        "pagedkv_coordinator_reconciled_total",
    ],
)
def test_every_new_metric_has_a_grafana_panel(name: str) -> None:
    dash = json.loads(
        (Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/pagedkv.json").read_text()
    )
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert any(re.search(rf"\b{name}\b", e) for e in exprs), f"no panel queries {name}"
