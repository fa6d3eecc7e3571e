"""bench.control's cluster, workload and baseline client: what it measures against."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.client.routing import CoordinatorRouting
from pagedkv.client.sync import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions, free_port
from pagedkv.protos import pagedkv_pb2 as pb

NODE = NodeOptions(
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype="float32",
    block_size=16,
    num_blocks=2048,
    host_blocks=256,
)
TENANT = "default"  # no tenants file: auth off, one tenant
PREFIX = "pkv:"
N_SYSTEM, SYSTEM_LEN, SUFFIX_LEN = 8, 1024, 128


def log(msg: str) -> None:
    print(f"[control {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pcts(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    if not ms:
        return {"n": 0}
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50_ms": statistics.median(ms), "p99_ms": p99, "mean_ms": statistics.fmean(ms), "n": len(ms)}


def w2_requests(n: int) -> tuple[list[list[int]], list[list[int]], str]:
    """(system prompts, W2 prompts) from kvbench's generator, or an exact replica of it."""
    peers = "/work/shared/peers"
    try:
        sys.path.insert(0, peers)
        from kvbench.workloads import w2_shared_prefix  # type: ignore[import-not-found]

        wl = w2_shared_prefix(n=n, n_system=N_SYSTEM, system_len=SYSTEM_LEN, suffix_len=SUFFIX_LEN)
        prompts = [r.prompt for r in wl.requests]
        source = "kvbench.workloads.w2_shared_prefix(seed=4321)"
        # the system prompts are the generator's first draws (some may be unpicked in `prompts`)
        rng = np.random.default_rng(4321)
        systems = [rng.integers(0, 32000, size=SYSTEM_LEN).tolist() for _ in range(N_SYSTEM)]
        assert all(p[:SYSTEM_LEN] in systems for p in prompts[:50])
        return systems, prompts, source
    except ImportError:
        pass
    finally:
        if sys.path and sys.path[0] == peers:
            sys.path.pop(0)
    rng = np.random.default_rng(4321)  # replica of w2_shared_prefix (same draws, same order)
    systems = [rng.integers(0, 32000, size=SYSTEM_LEN).tolist() for _ in range(N_SYSTEM)]
    pick = rng.integers(0, N_SYSTEM, size=n)
    prompts = []
    for i in range(n):
        suffix = rng.integers(0, 32000, size=SUFFIX_LEN).tolist()
        rng.integers(0, 32000, size=64)  # decode tokens (unused here)
        prompts.append(systems[int(pick[i])] + suffix)
    return systems, prompts, "replica of kvbench w2_shared_prefix(seed=4321)"


class BenchCluster(LocalCluster):
    """LocalCluster plus the measured coordinators: replicas on the same redis-server,
    one running this code (serving Prometheus /metrics: handler latency) and, on
    request, one running another git revision's code (the baseline). The nodes beat
    and report their block events to the cluster's own coordinator, so the two
    measured ones have the same role (before, this code was measured on the node-facing
    coordinator and the baseline on a replica, which favoured the baseline)."""

    metrics_port = 0
    current_address = ""
    baseline_address = ""

    def start_replica(self, name: str, import_root: Path | None = None, metrics_port: int = 0) -> str:
        """A coordinator on the same redis-server, importing pagedkv from import_root (None:
        this working tree). It sees the nodes through Redis (replica style)."""
        address = f"{self.host}:{free_port()}"
        args = [
            sys.executable,
            "-m",
            "pagedkv",
            "coordinator",
            f"--listen={address}",
            f"--lease-ttl-s={self.lease_ttl_s}",
            f"--redis={self.redis_url}",
        ]
        if metrics_port:
            args.append(f"--metrics-port={metrics_port}")
        log_file = open(Path(self.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}  # the cluster secret: it signs tickets
        cwd = Path(__file__).resolve().parent.parent
        if import_root is not None:
            env["PYTHONPATH"] = str(import_root)
            # cwd too: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH.
            cwd = import_root
        proc = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        self.procs[name] = proc
        self._wait_healthy(name, address)
        return address


def previous_token_list(token_ids: Any) -> list[int]:
    """codec.token_list before ce69823: int() per id, then the message copies the list."""
    return [int(t) for t in token_ids]


def with_previous_token_lists(client: CacheClient) -> None:
    """The baseline client builds its open and lookup requests the previous way (token
    ids converted one by one into a new list, then copied by the message), so the
    baseline rows are the previous client and coordinator together; `client` itself
    is this code's library, shared by both sides otherwise."""
    routing = client.routing
    assert isinstance(routing, CoordinatorRouting)

    def open_request(seq_id: str, token_ids: Any, max_cached: int | None) -> pb.CoordOpenRequest:
        spec_msg = pb.ModelSpec(**routing.spec.to_dict()) if routing.spec else None
        req = pb.CoordOpenRequest(seq_id=seq_id, token_ids=previous_token_list(token_ids), spec=spec_msg)
        if max_cached is not None:
            req.max_cached_tokens = max_cached
        return req

    def lookup(token_ids: Any, timeout_s: float | None = None) -> int:
        spec_msg = pb.ModelSpec(**routing.spec.to_dict()) if routing.spec else None
        req = pb.CoordLookupRequest(token_ids=previous_token_list(token_ids), spec=spec_msg)
        return routing._call("Lookup", req, timeout_s).num_cached_tokens

    routing._open_request = open_request  # type: ignore[method-assign]
    routing.lookup = lookup  # type: ignore[method-assign]
