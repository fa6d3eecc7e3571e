"""What the static checks of deploy/ share: the paths, the metric and environment names the
runtime uses, and running a tool when it is installed (skipping with the reason otherwise)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"

# The metric names the runtime exports (DESIGN.md "Contracts"; the deploy brief's list).
METRICS = {
    "pagedkv_kv_usage_ratio",
    "pagedkv_blocks",
    "pagedkv_prefix_cache_queries_tokens_total",
    "pagedkv_prefix_cache_hits_tokens_total",
    "pagedkv_evictions_total",
    "pagedkv_swaps_total",
    "pagedkv_sequences",
    "pagedkv_rpc_latency_seconds",
    "pagedkv_rpc_errors_total",
    "pagedkv_coordinator_nodes_live",
    "pagedkv_coordinator_open_total",
    "pagedkv_coordinator_cached_tokens_total",
    # tests/deploy/test_observability.py checks each of these against a running process
    "pagedkv_prefix_cache_host_hits_tokens_total",
    "pagedkv_swap_bytes_total",
    "pagedkv_node_info",
    "pagedkv_coordinator_info",
    "pagedkv_coordinator_nodes_suspect",
    "pagedkv_coordinator_tenant_open_total",
    "pagedkv_coordinator_tenant_prompt_tokens_total",
    "pagedkv_coordinator_tenant_cached_tokens_total",
    "pagedkv_coordinator_tenant_used_blocks",
    "pagedkv_coordinator_tenant_quota_blocks",
    "pagedkv_coordinator_redis_latency_seconds",
    "pagedkv_coordinator_redis_errors_total",
    "pagedkv_coordinator_nodes_reaped_total",
    "pagedkv_coordinator_reconciled_total",
}
HISTOGRAMS = {"pagedkv_rpc_latency_seconds", "pagedkv_coordinator_redis_latency_seconds"}
# A histogram is queried through its series; a bare histogram name is not a series.
SERIES = (METRICS - HISTOGRAMS) | {f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}

COORDINATOR_ENV = {
    "PAGEDKV_LISTEN",
    "PAGEDKV_REDIS_URL",
    "PAGEDKV_FRAME_PORT",
    "PAGEDKV_METRICS_PORT",
    "PAGEDKV_TENANTS_FILE",
    "PAGEDKV_LEASE_TTL_S",
    "PAGEDKV_CLUSTER_SECRET_FILE",
}
NODE_ENV = {
    "PAGEDKV_LISTEN",
    "PAGEDKV_ADVERTISE",
    "PAGEDKV_COORDINATOR",
    "PAGEDKV_METRICS_PORT",
    "PAGEDKV_NUM_LAYERS",
    "PAGEDKV_NUM_KV_HEADS",
    "PAGEDKV_HEAD_DIM",
    "PAGEDKV_DTYPE",
    "PAGEDKV_BLOCK_SIZE",
    "PAGEDKV_POOL_BYTES",
    "PAGEDKV_HOST_BYTES",
    "PAGEDKV_POLICY",
    "PAGEDKV_DEVICE",
    "PAGEDKV_CLUSTER_SECRET_FILE",
}
TLS_ENV = {"PAGEDKV_TLS_CERT", "PAGEDKV_TLS_KEY", "PAGEDKV_TLS_CA", "PAGEDKV_TLS_CLIENT_AUTH"}
IMAGE_ENV = {"PAGEDKV_KERNEL_DIR", "PAGEDKV_ATTENTION_BACKEND", "PAGEDKV_HEALTH_ADDR"}
METRIC_RE = re.compile(r"\bpagedkv_\w+")
TORCH_PIN = "torch==2.13.0"


def run_tool(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def find_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install -y {package})")
    return path


def check_metric_names(expr: str, where: str) -> None:
    names = set(METRIC_RE.findall(expr))
    unknown = names - SERIES
    assert not unknown, f"{where}: unknown metric names {sorted(unknown)} in {expr!r}"
