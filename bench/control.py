# ruff: noqa: E501  (report strings and table rows)
"""Control-plane benchmark (issue 4): open/close through the coordinator, side by side
with its floors, in one run, on a real local cluster (redis-server + coordinator + 2
nodes as processes).

    python -m bench.control                       # ~1 min; writes bench/results/control.{json,md}
    python -m bench.control --baseline-rev ea54b0a  # + a coordinator running that commit's code
    python -m bench.control --quick               # a smoke run (fewer iterations, no profile)

Before / after in ONE run: with --baseline-rev, a second coordinator process runs the
code of that git revision (`git archive` into a temporary folder, imported ahead of
the editable install) on the same redis-server and the same nodes; its opens, closes,
lookups and no-op RPC are measured in the same shuffled rounds as the current code's.
Both are replicas (the nodes beat and report to the cluster's own coordinator), and
the baseline's client builds its open and lookup requests the way the client did
before ce69823 (the bench process runs this code's client library for both).

Workload: W2 (/work/shared/peers/kvbench/workloads.py `w2_shared_prefix`: 8 system
prompts of 1,024 tokens + a unique 128-token suffix each, seeded). The cache is warmed
first (each system prompt opened, its KV appended, closed; the nodes' stored events
reach the prefix index), so every measured open hits 1,024 cached tokens.

Measured interleaved, round by round in a shuffled order (the host is small and shared):

- open / close through the coordinator (CacheClient.open -> Sequence.close), and open +
  the first append (what a worker waits for), through the baseline coordinator too
  when there is one;
- Lookup through the coordinator (RPC + keys + the match_prefix script, no node hop);
- the no-op RPC floor: grpc.health.v1 Health.Check on the coordinator (same server,
  same process, same channel as the client's control calls);
- a bare Redis round trip (redis-py PING to the same redis-server);
- the pieces of an open, called from the bench process: the open_sequence script (match
  + placement + page table, RedisStore) and delete_sequence, the match_prefix script with
  the keys as one packed argument and, side by side, the same script taking 71 arguments
  (the previous form), chain_keys and root_key (now cached per tenant), the node's own
  Open + Free RPCs (the hop the coordinator sends after the open), the node's Health.Check,
  and the client's own work on an open (the CoordOpenRequest built from 1,152 token ids,
  serialized) and the coordinator's first step on it (parse, the keys' ids sliced out).

Then, in separate phases:

- Redis commands per open and per close (and per baseline open/close), counted exactly: SLOWLOG with a 0 us threshold
  logs every command (name, args, server time, client); EVALSHA digests are mapped back
  to the RedisStore scripts, background traffic (heartbeats, reaper, node events) is
  told apart by script; INFO commandstats deltas are the cross-check;
- the coordinator's own Open/Close handler time (its Prometheus histogram, scraped);
- open+close throughput with 4 concurrent client threads;
- a py-spy profile (wall clock, --idle) of the coordinator process during opens, the
  Open handler's samples split by what Coordinator.open was calling.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.client import channels
from pagedkv.client.routing import CoordinatorRouting
from pagedkv.client.sync import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions, free_port
from pagedkv.coordinator import redis_scripts
from pagedkv.coordinator.records import NewSequence, NodeRoom
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos.keys import chain_keys, root_key
from pagedkv.protos.spec import ModelSpec

RESULTS = Path(__file__).resolve().parent / "results"
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


# ---------------------------------------------------------------------------- helpers


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
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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


def baseline_import_root(rev: str) -> tuple[Path, str]:
    """(a folder to put first on PYTHONPATH so `import pagedkv` runs `rev`'s code, its short hash).

    `git archive` of the revision into a temporary folder (the shared checkout and its
    worktree list are untouched), and a `pagedkv` package there that maps the roles'
    top-level folders the way the editable install does (pyproject's package-dir)."""
    repo = Path(__file__).resolve().parent.parent
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"pagedkv-baseline-{sha}"
    if not (tree / "coordinator").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pkg = tree / "import" / "pagedkv"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for f in (tree / "pagedkv").iterdir():
            (pkg / f.name).symlink_to(f)
        for role in ("protos", "cache_node", "client", "coordinator"):
            (pkg / role).symlink_to(tree / role)
    return tree / "import", sha


def scrape_handler_hist(port: int) -> dict[str, dict[str, Any]]:
    """{method: {sum, count, buckets{le: cumulative}}} of the coordinator's RPC latency histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"sum": 0.0, "count": 0.0, "buckets": {}})
    for fam in text_string_to_metric_families(text):
        if fam.name != "pagedkv_coordinator_rpc_latency_seconds":
            continue
        for s in fam.samples:
            m = s.labels.get("method", "")
            if s.name.endswith("_sum"):
                out[m]["sum"] = s.value
            elif s.name.endswith("_count"):
                out[m]["count"] = s.value
            elif s.name.endswith("_bucket"):
                out[m]["buckets"][s.labels["le"]] = s.value
    return dict(out)


def hist_delta(a: dict, b: dict, method: str) -> dict[str, float]:
    x, y = a.get(method), b.get(method)
    if not y:
        return {}
    n = y["count"] - (x["count"] if x else 0)
    s = y["sum"] - (x["sum"] if x else 0.0)
    res = {"count": n, "mean_ms": s / n * 1e3 if n else float("nan")}
    # bucket-resolution p50/p99 (upper bound of the bucket holding the quantile)
    buckets = sorted(
        ((float(le), c - (x["buckets"].get(le, 0) if x else 0)) for le, c in y["buckets"].items())
    )
    for q in (0.5, 0.99):
        for le, c in buckets:
            if c >= q * n:
                res[f"p{int(q * 100)}_le_ms"] = le * 1e3
                break
    return res


def script_names() -> dict[str, str]:
    """EVALSHA digest -> RedisStore script name."""
    names = {}
    for attr in dir(redis_scripts):
        val = getattr(redis_scripts, attr)
        if attr.isupper() and isinstance(val, str) and "redis.call" in val:
            names[hashlib.sha1(val.encode()).hexdigest()] = attr.strip("_").lower()
    return names


# The previous _MATCH_PREFIX: the same per-node SMISMEMBER, but every key its own
# argument (ARGV: P, key1, key2, ...; 72 arguments for a W2 open, each encoded by
# redis-py) instead of one packed argument split in Lua. Same reply (checked).
MATCH_ARGS = """
local P = ARGV[1]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', P .. 'nodes')) do
  if redis.call('EXISTS', P .. 'alive:' .. id) == 1 then
    local n, first = 0, 2
    while first <= #ARGV do
      local last = math.min(first + 3999, #ARGV)
      local held = redis.call('SMISMEMBER', P .. 'nkeys:' .. id, unpack(ARGV, first, last))
      local i = 1
      while i <= #held and held[i] == 1 do i = i + 1 end
      n = n + i - 1
      if i <= #held then break end
      first = last + 1
    end
    out[#out + 1] = id; out[#out + 1] = n
  end
end
return out
"""

BACKGROUND = {"heartbeat", "list_nodes", "apply_events", "register"}  # nodes' beats/events, reaper


def commandstats(r: redis.Redis) -> dict[str, int]:
    info = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def slowlog_entries(r: redis.Redis, me: str, shas: dict[str, str]) -> list[dict[str, Any]]:
    raw = r.execute_command("SLOWLOG GET -1")
    out = []
    for e in raw:
        # redis-py may parse the reply into dicts; handle both shapes
        if isinstance(e, dict):
            args, dur, addr = e.get("command", b""), e.get("duration", 0), e.get("client_address", b"")
            args = args.split() if isinstance(args, bytes | str) else args
        else:
            args, dur, addr = e[3], e[2], e[4]
        args = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args[:2]]
        addr = addr.decode() if isinstance(addr, bytes) else str(addr)
        if addr == me:  # the bench's own INFO / SLOWLOG / CONFIG
            continue
        cmd = args[0].lower() if args else "?"
        name = cmd
        if cmd == "evalsha" and len(args) > 1:
            name = "evalsha:" + shas.get(args[1], args[1][:8])
        elif cmd == "eval":
            name = "eval:" + shas.get(hashlib.sha1(args[1].encode()).hexdigest(), "?")
        # commands a Lua script runs come from the fake client "?:0": not round trips
        out.append({"name": name, "us": int(dur), "addr": addr, "in_script": addr.startswith("?")})
    return out


def find_pyspy() -> str | None:
    for cand in (os.environ.get("PYSPY", ""), shutil.which("py-spy") or "", "/tmp/pyspy/bin/py-spy"):
        if cand and os.path.exists(cand):
            return cand
    return None


# ---------------------------------------------------------------------------- profile


def _fname(frame: str) -> str:
    """'Coordinator.open (coordinator/core.py:270)' -> 'Coordinator.open@core.py'"""
    fn, _, where = frame.partition(" (")
    return f"{fn}@{os.path.basename(where.split(':')[0])}"


def summarize_profile(raw_path: Path) -> dict[str, Any]:
    """Split the samples of the coordinator's Open / Close handlers by what they were calling."""
    per: dict[str, Counter] = {"Open": Counter(), "Close": Counter()}
    totals: Counter = Counter()
    threads: Counter = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [_fname(f) for f in stack.split(";")]
        totals["all"] += n
        handler = next(
            (
                h
                for h in ("CoordinatorServicer.Open@service.py", "CoordinatorServicer.Close@service.py")
                if h in frames
            ),
            None,
        )
        if handler is None:
            threads["other (idle pool workers, reaper, grpc, metrics)"] += n
            continue
        method = handler.split("@")[0].split(".")[-1]
        core = f"Coordinator.{method.lower()}@core.py"
        if core in frames:
            i = frames.index(core)
            cat = frames[i + 1] if i + 1 < len(frames) else f"{core} (own code)"
            # one level deeper for the store / node hops, which is where time goes
            if cat == "Coordinator._call@core.py":
                cat = "node " + ("Open" if method == "Open" else "Free") + " gRPC (Coordinator._call)"
            cat = f"Coordinator.{method.lower()} -> {cat}"
        else:
            i = frames.index(handler)
            rest = frames[i + 1 :]
            inner = [
                f
                for f in rest
                if f.split("@")[0] not in ("observe", "CoordinatorServicer._run")
                and not f.startswith(f"CoordinatorServicer.{method}.<locals>.run@")
            ]
            cat = f"handler (outside Coordinator.{method.lower()}) -> {inner[0] if inner else 'own code'}"
        per[method][cat] += n
    out: dict[str, Any] = {"total_samples": totals["all"], "non_handler_samples": sum(threads.values())}
    for method, c in per.items():
        tot = sum(c.values())
        out[method] = {
            "samples": tot,
            "breakdown": [{"what": k, "samples": v, "share": v / tot} for k, v in c.most_common()],
        }
    return out


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=600, help="interleaved rounds (one sample of each variant)")
    ap.add_argument("--count-ops", type=int, default=200, help="opens (and closes) in the counting phase")
    ap.add_argument("--profile-s", type=float, default=6.0, help="py-spy duration (0 = off)")
    ap.add_argument("--concurrency", type=int, default=4, help="client threads in the throughput phase")
    ap.add_argument("--quick", action="store_true", help="smoke run: 60 rounds, 30 counted ops, no profile")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument(
        "--baseline-rev",
        default="",
        help="git revision whose coordinator runs side by side in the same rounds (the 'before')",
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.count_ops, args.profile_s = 60, 30, 0.0
    t_start = time.monotonic()
    load_before = os.getloadavg()

    n_prompts = args.rounds + args.count_ops + 4000
    systems, prompts, source = w2_requests(n_prompts)
    log(f"W2 prompts: {len(prompts)} ({source}); {N_SYSTEM} system prompts x {SYSTEM_LEN} + {SUFFIX_LEN}")

    cluster = BenchCluster(num_nodes=2, node=NODE, use_redis=True)
    cluster.metrics_port = free_port()
    log("starting redis-server + coordinator + 2 nodes ...")
    with cluster:
        log("cluster up:\n" + cluster.describe())
        assert cluster.redis_url, "redis-server is not on the PATH: this benchmark needs Redis"
        cluster.current_address = cluster.start_replica("coordinator-current", None, cluster.metrics_port)
        log(f"measured coordinator (this code) at {cluster.current_address}")
        baseline_git = ""
        if args.baseline_rev:
            root, baseline_git = baseline_import_root(args.baseline_rev)
            cluster.baseline_address = cluster.start_replica("coordinator-baseline", root)
            log(f"baseline coordinator (git {baseline_git}) at {cluster.baseline_address}")
        result = run(cluster, args, systems, prompts, source)
        result["baseline_git"] = baseline_git
    result["runtime_s"] = time.monotonic() - t_start
    result["loadavg_before"] = load_before
    result["loadavg_after"] = os.getloadavg()
    result["findings"] = findings(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "control.json").write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    (out / "control.md").write_text(render(result))
    log(f"done in {result['runtime_s']:.0f} s: {out / 'control.json'}, {out / 'control.md'}")
    print(render(result))


def run(cluster: BenchCluster, args: argparse.Namespace, systems, prompts, source) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    spec = ModelSpec(**NODE.spec())
    bs = NODE.block_size
    client = CacheClient(coordinator=cluster.current_address, spec=spec)
    base = CacheClient(coordinator=cluster.baseline_address, spec=spec) if cluster.baseline_address else None
    if base is not None:
        with_previous_token_lists(base)
    r = redis.Redis.from_url(cluster.redis_url)
    me = r.execute_command("CLIENT INFO")  # a dict under RESP3 (redis-py 8), else "id=.. addr=.. ..."
    if isinstance(me, dict):
        me_addr = str(me.get("addr", ""))
    else:
        me = me.decode() if isinstance(me, bytes) else str(me)
        me_addr = next((kv.split("=", 1)[1] for kv in me.split() if kv.startswith("addr=")), "")
    store = RedisStore(cluster.redis_url)
    coord_channel = channels.acquire(cluster.current_address, client.config)  # the client's own channel
    coord_health = health_pb2_grpc.HealthStub(coord_channel)
    base_health = (
        health_pb2_grpc.HealthStub(channels.acquire(cluster.baseline_address, base.config)) if base else None
    )
    hreq = health_pb2.HealthCheckRequest(service="")
    g = torch.Generator().manual_seed(0)

    # -- warm: each system prompt opened, its KV appended, closed (blocks stay cached)
    log("warming: 8 system prompts (open + append 1,024 tokens of KV + close) ...")
    node_of_system: dict[int, str] = {}
    for i, sysp in enumerate(systems):
        seq = client.open(f"warm-{i}", sysp)
        shape = (NODE.num_layers, len(sysp), NODE.num_kv_heads, NODE.head_dim)
        seq.append(sysp, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        node_of_system[i] = seq.route.address
        seq.close()
    deadline = time.monotonic() + 15
    while True:
        hits = [client.lookup(s + [1] * SUFFIX_LEN) for s in systems]
        if all(h == SYSTEM_LEN for h in hits) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    log(
        f"prefix index warm: lookup hits {hits} (want {SYSTEM_LEN} each); nodes {sorted(set(node_of_system.values()))}"
    )
    salt = bytes(r.get(f"{PREFIX}salt:{TENANT}"))
    root = root_key(salt)
    if base is not None:  # the baseline sees the same index (same Redis, same salt)
        assert [base.lookup(s + [1] * SUFFIX_LEN) for s in systems] == hits, "baseline lookup differs"
    sys_index = {tuple(s): i for i, s in enumerate(systems)}

    def sys_of(p: list[int]) -> int:
        return sys_index[tuple(p[:SYSTEM_LEN])]

    node_stubs = {
        a: pb_grpc.CacheNodeStub(channels.acquire(a, client.config)) for a in cluster.node_addresses
    }
    node_health = {
        a: health_pb2_grpc.HealthStub(channels.acquire(a, client.config)) for a in cluster.node_addresses
    }

    # -- variants: each returns {name: seconds}
    it = iter(range(10**9))
    cached_seen: Counter = Counter()
    base_cached_seen: Counter = Counter()  # not asserted: before 2f39e06 a replica's node cache
    # counted opens and never closes, so at a fast open rate it saw the prefix's node as full

    def v_open_close(p: list[int]) -> dict[str, float]:
        sid = f"oc-{next(it)}"
        t0 = time.perf_counter()
        seq = client.open(sid, p)
        t1 = time.perf_counter()
        seq.close()
        t2 = time.perf_counter()
        cached_seen[seq.num_cached_tokens] += 1
        return {"open": t1 - t0, "close": t2 - t1, "open+close": t2 - t0}

    def v_open_close_base(p: list[int]) -> dict[str, float]:
        assert base is not None
        sid = f"ob-{next(it)}"
        t0 = time.perf_counter()
        seq = base.open(sid, p)
        t1 = time.perf_counter()
        seq.close()
        t2 = time.perf_counter()
        base_cached_seen[seq.num_cached_tokens] += 1
        return {"open_before": t1 - t0, "close_before": t2 - t1}

    suffix_shape = (NODE.num_layers, SUFFIX_LEN, NODE.num_kv_heads, NODE.head_dim)
    suffix_k, suffix_v = torch.randn(suffix_shape, generator=g), torch.randn(suffix_shape, generator=g)

    def v_open_append(p: list[int]) -> dict[str, float]:
        """What a worker waits for before its first attention: the open, then the KV of
        the uncached suffix (the first data call, on the node the open named)."""
        sid = f"oa-{next(it)}"
        # Its own suffix: the appended blocks get cached, and the other variants reuse p.
        p = p[:SYSTEM_LEN] + [t + 1_000_003 for t in p[SYSTEM_LEN:]]
        t0 = time.perf_counter()
        seq = client.open(sid, p)
        m = seq.num_cached_tokens
        n = len(p) - m
        if n == SUFFIX_LEN:
            seq.append(p[m:], suffix_k, suffix_v)
        else:  # a miss (not expected once warm): append what is missing
            shape = (NODE.num_layers, n, NODE.num_kv_heads, NODE.head_dim)
            seq.append(p[m:], torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        t1 = time.perf_counter()
        seq.close()
        return {"open+append": t1 - t0}

    def v_open_append_base(p: list[int]) -> dict[str, float]:
        assert base is not None
        sid = f"ab-{next(it)}"
        p = p[:SYSTEM_LEN] + [t + 2_000_003 for t in p[SYSTEM_LEN:]]
        t0 = time.perf_counter()
        seq = base.open(sid, p)
        assert seq.num_cached_tokens == SYSTEM_LEN
        seq.append(p[SYSTEM_LEN:], suffix_k, suffix_v)
        t1 = time.perf_counter()
        seq.close()
        return {"open+append_before": t1 - t0}

    def v_client_encode(p: list[int]) -> dict[str, float]:
        """The client's part of an open (request built and serialized), and the
        coordinator's first step (parse; the ids the keys hash, sliced out)."""
        t0 = time.perf_counter()
        data = client.routing._open_request("x" * 32, p, None).SerializeToString()
        t1 = time.perf_counter()
        req = pb.CoordOpenRequest.FromString(data)
        req.token_ids[: (len(p) - 1) // bs * bs]
        t2 = time.perf_counter()
        before = pb.CoordOpenRequest(seq_id="x" * 32, token_ids=previous_token_list(p), spec=req.spec)
        before.SerializeToString()
        t3 = time.perf_counter()
        return {
            "client_open_request": t1 - t0,
            "server_parse_slice": t2 - t1,
            "client_open_request_before": t3 - t2,
        }

    def v_lookup(p: list[int]) -> dict[str, float]:
        t0 = time.perf_counter()
        client.lookup(p)
        return {"lookup": time.perf_counter() - t0}

    def v_health(p: list[int]) -> dict[str, float]:
        t0 = time.perf_counter()
        coord_health.Check(hreq, timeout=5)
        return {"coord_health": time.perf_counter() - t0}

    def v_lookup_base(p: list[int]) -> dict[str, float]:
        assert base is not None
        t0 = time.perf_counter()
        base.lookup(p)
        return {"lookup_before": time.perf_counter() - t0}

    def v_health_base(p: list[int]) -> dict[str, float]:
        assert base_health is not None
        t0 = time.perf_counter()
        base_health.Check(hreq, timeout=5)
        return {"coord_health_before": time.perf_counter() - t0}

    def v_ping(p: list[int]) -> dict[str, float]:
        t0 = time.perf_counter()
        r.ping()
        return {"redis_ping": time.perf_counter() - t0}

    def v_match(p: list[int]) -> dict[str, float]:
        keys = chain_keys(root, p[: (len(p) - 1) // bs * bs], bs)
        t0 = time.perf_counter()
        counts = store.match_prefix(keys)
        t1 = time.perf_counter()
        assert max(counts.values()) == SYSTEM_LEN // bs, counts
        return {"match_prefix_script": t1 - t0}

    r_cand = redis.Redis.from_url(cluster.redis_url)  # not `r`: SLOWLOG drops the bench's own connection
    match_args = r_cand.register_script(MATCH_ARGS)
    checked = Counter()

    def v_match_args(p: list[int]) -> dict[str, float]:
        keys = chain_keys(root, p[: (len(p) - 1) // bs * bs], bs)
        t0 = time.perf_counter()
        flat = match_args(args=[PREFIX, *keys])
        t1 = time.perf_counter()
        got = {
            (k.decode() if isinstance(k, bytes) else k): int(v)
            for k, v in zip(flat[::2], flat[1::2], strict=True)
        }
        if checked["match"] < 20:  # same reply as the product script (warm-up rounds only)
            checked["match"] += 1
            assert got == store.match_prefix(keys), (got, store.match_prefix(keys))
        return {"match_args_script": t1 - t0}

    def v_keys(p: list[int]) -> dict[str, float]:
        t0 = time.perf_counter()
        b"".join(chain_keys(root, p[: (len(p) - 1) // bs * bs], bs))
        t1 = time.perf_counter()
        root_key(salt)
        return {"chain_keys_71_blocks": t1 - t0, "root_key": time.perf_counter() - t1}

    rooms = tuple(NodeRoom(f"node-{i}", NODE.num_blocks // 2, NODE.num_blocks) for i in range(2))

    def v_seq_scripts(p: list[int]) -> dict[str, float]:
        sid = f"ss-{next(it)}"
        keys = b"".join(chain_keys(root, p[: (len(p) - 1) // bs * bs], bs))
        new = NewSequence(sid, TENANT, len(p), -(-len(p) // bs), bs, keys, rooms)
        t0 = time.perf_counter()
        placement = store.open_sequence(new)
        t1 = time.perf_counter()
        store.delete_sequence(sid)
        t2 = time.perf_counter()
        assert placement.cached_tokens == SYSTEM_LEN, placement
        return {"open_sequence_script": t1 - t0, "delete_sequence_script": t2 - t1}

    def v_node(p: list[int]) -> dict[str, float]:
        addr = node_of_system[sys_of(p)]
        stub = node_stubs[addr]
        sid = f"nd-{next(it)}"
        t0 = time.perf_counter()
        rep = stub.Open(pb.OpenRequest(seq_id=sid, token_ids=p, tenant_salt=salt), timeout=10)
        t1 = time.perf_counter()
        stub.Free(pb.SeqRequest(seq_id=sid), timeout=10)
        t2 = time.perf_counter()
        assert rep.num_cached_tokens == SYSTEM_LEN, rep
        return {"node_open_direct": t1 - t0, "node_free_direct": t2 - t1}

    def v_node_health(p: list[int]) -> dict[str, float]:
        addr = node_of_system[sys_of(p)]
        t0 = time.perf_counter()
        node_health[addr].Check(hreq, timeout=5)
        return {"node_health": time.perf_counter() - t0}

    variants = [
        v_open_close,
        v_open_append,
        v_lookup,
        v_health,
        v_ping,
        v_match,
        v_match_args,
        v_keys,
        v_seq_scripts,
        v_node,
        v_node_health,
        v_client_encode,
    ]
    if base is not None:
        variants += [v_open_close_base, v_open_append_base, v_lookup_base, v_health_base]
    samples: dict[str, list[float]] = defaultdict(list)
    pi = iter(prompts)

    # short warm-up of every variant (connections, scripts loaded, caches)
    for _ in range(20):
        p = next(pi)
        for v in variants:
            v(p)
    cached_seen.clear()
    base_cached_seen.clear()

    h0 = scrape_handler_hist(cluster.metrics_port)
    rng = random.Random(7)
    log(f"measuring {args.rounds} interleaved rounds of {len(variants)} variants ...")
    t_meas = time.monotonic()
    for k in range(args.rounds):
        p = next(pi)
        order = variants[:]
        rng.shuffle(order)
        for v in order:
            for name, s in v(p).items():
                samples[name].append(s)
        if (k + 1) % 100 == 0:
            o = pcts(samples["open"])
            h = pcts(samples["coord_health"])
            log(
                f"  round {k + 1}/{args.rounds}: open p50 {o['p50_ms']:.2f} ms, health p50 {h['p50_ms']:.2f} ms"
            )
    meas_s = time.monotonic() - t_meas
    h1 = scrape_handler_hist(cluster.metrics_port)
    lat = {name: pcts(s) for name, s in samples.items()}
    handler = {m: hist_delta(h0, h1, m) for m in ("Open", "Close", "Lookup")}
    cached_measured = dict(cached_seen)
    log(f"measured in {meas_s:.0f} s; cached tokens per open: {cached_measured}")
    if base is not None:
        log(f"baseline's cached tokens per open: {dict(base_cached_seen)}")

    # -- Redis commands per open / per close, exactly (SLOWLOG, 0 us threshold)
    log(f"counting Redis commands over {args.count_ops} opens, then {args.count_ops} closes ...")
    # MATCH_ARGS is byte for byte the baseline's match_prefix script (same digest)
    shas = {**script_names(), hashlib.sha1(MATCH_ARGS.encode()).hexdigest(): "match_args"}
    old_cfg = {k: r.config_get(k)[k] for k in ("slowlog-log-slower-than", "slowlog-max-len")}
    r.config_set("slowlog-max-len", 100000)
    counts: dict[str, Any] = {}
    seqs: dict[str, list] = defaultdict(list)
    phases = ("open", "close") + (("open_before", "close_before") if base is not None else ())
    try:
        r.config_set("slowlog-log-slower-than", 0)
        for phase in phases:
            r.slowlog_reset()
            cs0 = commandstats(r)
            t0 = time.monotonic()
            if phase.startswith("open"):
                c = client if phase == "open" else base
                assert c is not None
                for _ in range(args.count_ops):
                    seqs[phase].append(c.open(f"cnt-{next(it)}", next(pi)))
            else:
                for s in seqs[phase.replace("close", "open")]:
                    s.close()
            dt = time.monotonic() - t0
            cs1 = commandstats(r)
            entries = slowlog_entries(r, me_addr, shas)
            by = Counter(e["name"] for e in entries if not e["in_script"])
            in_script = Counter(e["name"] for e in entries if e["in_script"])
            us = defaultdict(list)
            for e in entries:
                if not e["in_script"]:
                    us[e["name"]].append(e["us"])
            fg = {k: v for k, v in by.items() if k.split(":")[-1] not in BACKGROUND}
            bg = {k: v for k, v in by.items() if k.split(":")[-1] in BACKGROUND}
            delta = {k: cs1.get(k, 0) - cs0.get(k, 0) for k in cs1}
            delta = {k: v for k, v in delta.items() if v}
            n = args.count_ops
            counts[phase] = {
                "ops": n,
                "window_s": dt,
                "per_op_total": sum(fg.values()) / n,
                "per_op_by_command": {k: v / n for k, v in sorted(fg.items())},
                "background_in_window": bg,
                "commands_inside_scripts_per_op": {k: v / n for k, v in sorted(in_script.items())},
                "server_us_per_call": {
                    k: {"p50": statistics.median(v), "max": max(v)} for k, v in us.items()
                },
                "commandstats_delta": delta,
                "commandstats_per_op_minus_background": (
                    sum(delta.values())
                    - sum(in_script.values())
                    - sum(bg.values())
                    - delta.get("slowlog|get", 0)
                    - delta.get("info", 0)
                    - delta.get("slowlog|reset", 0)
                )
                / n,
            }
            log(
                f"  {phase}: {counts[phase]['per_op_total']:.2f} Redis commands per {phase} "
                f"{counts[phase]['per_op_by_command']} (background in window: {bg})"
            )
        # server-side time of the match_prefix script, keys packed vs one argument each, and of open_sequence
        r.slowlog_reset()
        for p in prompts[:100]:
            v_match(p)
            v_match_args(p)
            v_seq_scripts(p)
        script_us: dict[str, list[int]] = defaultdict(list)
        for e in slowlog_entries(r, me_addr, shas):
            if not e["in_script"] and e["name"].startswith(("evalsha:match", "evalsha:open_seq")):
                script_us[e["name"]].append(e["us"])
        counts["match_script_server_us"] = {
            k: {
                "p50": statistics.median(v),
                "p99": sorted(v)[min(len(v) - 1, round(0.99 * (len(v) - 1)))],
                "n": len(v),
            }
            for k, v in script_us.items()
        }
        log(f"  match script server time (us): {counts['match_script_server_us']}")
    finally:
        for k, v in old_cfg.items():
            r.config_set(k, v)
        for opened in seqs.values():
            for s in opened:
                if not s.is_closed:
                    s.close()

    # -- throughput with concurrent clients
    conc: dict[str, Any] = {}
    if args.concurrency > 1:
        log(f"throughput: {args.concurrency} threads of open+close for 3 s ...")
        stop = threading.Event()
        done = Counter()
        lock = threading.Lock()
        plist = prompts[:2000]

        def worker(w: int) -> None:
            j = 0
            while not stop.is_set():
                s = client.open(f"thr-{w}-{j}", plist[(w * 997 + j) % len(plist)])
                s.close()
                j += 1
            with lock:
                done["ops"] += j

        ths = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        time.sleep(3.0)
        stop.set()
        for t in ths:
            t.join()
        el = time.perf_counter() - t0
        conc = {"threads": args.concurrency, "open_close_per_s": done["ops"] / el, "seconds": el}
        log(f"  {conc['open_close_per_s']:.0f} open+close/s with {args.concurrency} threads")

    # -- profile of the coordinator during sequential opens + closes
    profile: dict[str, Any] = {}
    pyspy = find_pyspy()
    if args.profile_s > 0 and pyspy:
        pid = cluster.procs["coordinator-current"].pid
        raw = Path(cluster.log_dir) / "coordinator.pyspy.txt"
        log(f"profiling the coordinator (pid {pid}) with py-spy for {args.profile_s:.0f} s ...")
        cmd = [
            pyspy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(args.profile_s)),
            "--rate",
            "1000",
            "--idle",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
        ]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)
        n_ops = 0
        while spy.poll() is None:  # prompts reused in turn: the W2 list can run out on a quick host
            v_open_close(prompts[n_ops % len(prompts)])
            n_ops += 1
        err = spy.stderr.read().decode()[-500:] if spy.stderr else ""
        if spy.returncode == 0 and raw.exists():
            profile = summarize_profile(raw)
            profile.update(
                {
                    "tool": "py-spy record --idle --rate 1000 --nonblocking (wall clock)",
                    "open_close_ops": n_ops,
                    "raw": str(raw),
                }
            )
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, Path(args.out) / "control.pyspy.txt")
            for m in ("Open", "Close"):
                log(
                    f"  {m}: "
                    + ", ".join(f"{b['what']} {b['share']:.0%}" for b in profile[m]["breakdown"][:6])
                )
        else:
            profile = {"error": f"py-spy exited {spy.returncode}: {err}"}
            log(f"  py-spy failed: {err}")
    elif args.profile_s > 0:
        profile = {"error": "py-spy not found (pip install py-spy, or set PYSPY=/path/to/py-spy)"}

    redis_info = r.info("server")
    store.close()
    r_cand.close()
    client.close()
    if base is not None:
        base.close()
    r.close()

    def ver(p: str) -> str:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return "-"

    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    ).stdout.strip()
    open_p50, health_p50 = lat["open"]["p50_ms"], lat["coord_health"]["p50_ms"]
    return {
        "benchmark": "bench/control.py (issue 4: control-plane latency)",
        "workload": {
            "source": source,
            "n_system": N_SYSTEM,
            "system_len": SYSTEM_LEN,
            "suffix_len": SUFFIX_LEN,
            "cached_tokens_per_open": cached_measured,
            "baseline_cached_tokens_per_open": dict(base_cached_seen),
        },
        "spec": NODE.spec(),
        "cluster": {
            "nodes": 2,
            "num_blocks": NODE.num_blocks,
            "store": "redis",
            "lease_ttl_s": cluster.lease_ttl_s,
        },
        "rounds": args.rounds,
        "measure_s": meas_s,
        "latency": lat,
        "coordinator_handler": handler,
        "redis_commands": counts,
        "throughput": {"sequential_open_close_per_s": 1e3 / lat["open+close"]["mean_ms"], "concurrent": conc},
        "profile": profile,
        "goals": {
            "redis_round_trips_per_open": counts["open"]["per_op_total"],
            "redis_round_trips_per_open_goal": 2,
            "redis_round_trips_met": counts["open"]["per_op_total"] <= 2,
            "open_p50_over_noop_rpc_p50": open_p50 / health_p50,
            "open_p50_goal_ratio": 2.0,
            "open_p50_met": open_p50 <= 2 * health_p50,
        },
        "versions": {
            "python": platform.python_version(),
            "grpcio": ver("grpcio"),
            "protobuf": ver("protobuf"),
            "redis-py": ver("redis"),
            "hiredis": ver("hiredis"),
            "redis-server": redis_info.get("redis_version"),
            "torch": torch.__version__,
            "pagedkv_git": git,
        },
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform()},
    }


def findings(r: dict) -> str:
    """The findings paragraphs, computed from this run's numbers."""
    lat, g, h = r["latency"], r["goals"], r["coordinator_handler"]
    p50 = {k: v["p50_ms"] for k, v in lat.items() if v.get("n")}
    floor, hmean = p50["coord_health"], h["Open"].get("mean_ms", float("nan"))
    c = r["redis_commands"]
    text = [
        f"Round trips: an open costs {g['redis_round_trips_per_open']:.2f} Redis commands (one EVALSHA "
        "open_sequence: the prefix match on every candidate node, placement.place ported to Lua, the tenant's "
        "quota and the page table in one script); a close costs "
        f"{c['close']['per_op_total']:.2f} (EVALSHA delete_sequence, tenant-checked in the script)."
        + (
            f" The baseline coordinator (git {r['baseline_git']}) in the same run: "
            f"{c['open_before']['per_op_total']:.2f} per open "
            f"({', '.join(f'{k} {v:g}' for k, v in c['open_before']['per_op_by_command'].items())})."
            if "open_before" in c
            else ""
        ),
        f"Latency: open p50 {p50['open']:.2f} ms is {g['open_p50_over_noop_rpc_p50']:.2f}x the no-op RPC p50 "
        f"({floor:.2f} ms): the 2x goal is {'met' if g['open_p50_met'] else 'not met'}. What the open waits for: "
        f"the client -> coordinator RPC (~{floor:.2f} ms, the Health.Check floor) + the Open handler "
        f"({hmean:.2f} ms mean) + the client's request encoding (1,152 token ids, built and serialized: p50 "
        f"{p50.get('client_open_request', float('nan')):.3f} ms); the node Open is sent after the page table is "
        "written and never waited for.",
    ]
    if "open_before" in p50:
        hb = p50["coord_health_before"]
        oa = (
            f" Open + first append {p50['open+append_before']:.2f} -> {p50['open+append']:.2f} ms."
            if "open+append_before" in p50
            else ""
        )
        text.append(
            f"Before / after, same rounds: the baseline coordinator (git {r['baseline_git']}) opens in "
            f"{p50['open_before']:.2f} ms p50 = {p50['open_before'] / hb:.2f}x its own no-op RPC ({hb:.2f} ms); "
            f"this code {p50['open']:.2f} ms = {p50['open'] / floor:.2f}x ({p50['open_before'] - p50['open']:+.2f} "
            f"ms saved per open).{oa} Lookup {p50['lookup_before']:.2f} -> {p50['lookup']:.2f} ms; close "
            f"{p50['close_before']:.2f} -> {p50['close']:.2f} ms. Both are replicas: neither serves the nodes' "
            "heartbeats or events."
        )
    prof = r.get("profile") or {}
    if "Open" in prof:
        shares = {b["what"]: b["share"] for b in prof["Open"]["breakdown"]}
        # the node Open is sent by Coordinator._send_open, or where the servicer holds it back
        # (NodeCalls.held: the with-block's exit, outside Coordinator.open)
        node = sum(v for k, v in shares.items() if "_send_open" in k or "__exit__@contextlib" in k)
        os_ = sum(v for k, v in shares.items() if "open_sequence" in k)
        keys = sum(v for k, v in shares.items() if "chain_keys" in k)
        rest = max(0.0, 1 - node - os_ - keys)
        text.append(
            f"Inside the Open handler (py-spy, wall clock): the open_sequence script {os_:.0%} (~{os_ * hmean:.2f} "
            f"ms; direct p50 {p50['open_sequence_script']:.2f} ms), chain_keys {keys:.0%}, sending the node Open "
            f"{node:.0%} (~{node * hmean:.2f} ms), everything else (request decoding, NewSequence, node cache, "
            f"servicer) {rest:.0%} (~{rest * hmean:.2f} ms)."
        )
    ms = c.get("match_script_server_us", {})
    if "match_args_script" in p50:
        text.append(
            f"Keys as one packed argument (split in Lua with string.sub) vs 71 arguments: match_prefix client p50 "
            f"{p50['match_prefix_script']:.3f} ms vs {p50['match_args_script']:.3f} ms"
            + (
                f", server time p50 {ms['evalsha:match_prefix']['p50']:g} us vs {ms['evalsha:match_args']['p50']:g} us"
                if "evalsha:match_args" in ms and "evalsha:match_prefix" in ms
                else ""
            )
            + f". root_key per call, now cached per tenant: p50 {p50['root_key'] * 1e3:.1f} us; chain_keys over "
            f"71 blocks (joined): {p50['chain_keys_71_blocks'] * 1e3:.1f} us."
        )
    lower = floor + p50["redis_ping"]
    text.append(
        f"Floor of this design: one client RPC + one Redis round trip with zero work is {floor:.2f} + "
        f"{p50['redis_ping']:.2f} = {lower:.2f} ms = {lower / floor:.2f}x the no-op RPC; lookup (one RPC, one "
        f"Redis round trip, no writes) is {p50['lookup'] / floor:.2f}x ({p50['lookup']:.2f} ms)."
    )
    if "open+append" in p50:
        text.append(
            f"What a worker waits for before its first attention, open + first append of the 128 new tokens' "
            f"KV: p50 {p50['open+append']:.2f} ms. The append goes straight to the node and, when it overtakes "
            "the node Open, waits there for it (grace, condition variable) instead of failing NOT_FOUND."
        )
    return "\n\n".join(text)


def render(r: dict) -> str:
    lat = r["latency"]

    def row(label: str, key: str, note: str = "") -> str:
        x = lat.get(key)
        if not x or not x.get("n"):
            return f"| {label} | - | - | - | {note} |"
        return f"| {label} | {x['p50_ms']:.3f} | {x['p99_ms']:.3f} | {x['n']} | {note} |"

    g = r["goals"]
    c = r["redis_commands"]
    h = r["coordinator_handler"]
    bg = r.get("baseline_git", "")
    lines = [
        "# Control-plane latency (bench/control.py, issue 4)",
        "",
        f"Local cluster: redis-server {r['versions']['redis-server']} + coordinator + 2 nodes, each its own "
        "process; the measured coordinators (this code and the baseline) are replicas on the same Redis, "
        f"the nodes beat and report events to the cluster's own coordinator; all on one host ({r['host']['cpus']} CPUs, shared; loadavg before {r['loadavg_before'][0]:.2f}, "
        f"after {r['loadavg_after'][0]:.2f}). Spec {r['spec']}. Workload W2 ({r['workload']['source']}): "
        f"prompts of {SYSTEM_LEN} + {SUFFIX_LEN} tokens; every measured open hit "
        f"{', '.join(f'{k} tokens x{v}' for k, v in r['workload']['cached_tokens_per_open'].items())}. "
        f"{r['rounds']} interleaved rounds (shuffled order per round), one client thread. "
        f"Runtime {r['runtime_s']:.0f} s. grpcio {r['versions']['grpcio']}, redis-py {r['versions']['redis-py']} "
        f"(hiredis {r['versions'].get('hiredis', '-')}), Python {r['versions']['python']}, git "
        f"{r['versions']['pagedkv_git']}"
        + (f"; baseline coordinator: git {bg}, same redis-server and nodes, same rounds." if bg else "."),
        "",
        "| call (from the bench process) | p50 ms | p99 ms | n | what it is |",
        "|---|---:|---:|---:|---|",
        row(
            "**open** (CacheClient.open)",
            "open",
            "RPC to coordinator: keys + open_sequence (1 Redis round trip); node Open sent after the script, not awaited",
        ),
        row(
            "**close** (Sequence.close)",
            "close",
            "RPC to coordinator: delete_sequence (tenant-checked); node Free sent, not awaited",
        ),
        row(
            "**open + first append** (128 new tokens' KV)",
            "open+append",
            "what a worker waits for before its first attention",
        ),
        row("lookup (CacheClient.lookup)", "lookup", "RPC to coordinator: keys + match_prefix, no node hop"),
        row("**no-op RPC**: coordinator Health.Check", "coord_health", "same server, process and channel"),
    ]
    if bg:
        lines += [
            row(
                f"open, baseline coordinator (git {bg})",
                "open_before",
                f"{c['open_before']['per_op_total']:.0f} Redis round trip(s); that revision's coordinator, requests built the previous way"
                if "open_before" in c
                else "",
            ),
            row(f"open + first append, baseline coordinator (git {bg})", "open+append_before", ""),
            row(f"close, baseline coordinator (git {bg})", "close_before", ""),
            row(f"lookup, baseline coordinator (git {bg})", "lookup_before", ""),
            row(f"no-op RPC, baseline coordinator (git {bg})", "coord_health_before", "its own Health.Check"),
        ]
    lines += [
        row("**bare Redis PING** (redis-py)", "redis_ping", "same redis-server"),
        row(
            "open_sequence script (RedisStore)",
            "open_sequence_script",
            "71 keys, 64 hit, 2 candidates: match + place + write",
        ),
        row("delete_sequence script", "delete_sequence_script", ""),
        row(
            "match_prefix script, keys packed", "match_prefix_script", "71 keys in one argument, split in Lua"
        ),
        row("match_prefix script, 71 key arguments", "match_args_script", "the previous form; same reply"),
        row("chain_keys (71 blocks, joined)", "chain_keys_71_blocks", "the keys the coordinator hashes"),
        row("root_key (per call before, cached now)", "root_key", "one SHA-256 of the salt"),
        row("node Open RPC, direct", "node_open_direct", "the hop open sends, off its path (1,024 cached)"),
        row("node Free RPC, direct", "node_free_direct", "the hop close sends, off its path"),
        row("node Health.Check", "node_health", "no-op RPC floor of the node"),
        row(
            "client: CoordOpenRequest built + serialized",
            "client_open_request",
            "1,152 token ids, from a list",
        ),
        row(
            "client: the same, the previous way",
            "client_open_request_before",
            "int() per id into a new list, then the message (before ce69823)",
        ),
        row("coordinator: request parsed + key ids sliced", "server_parse_slice", "before chain_keys"),
        "",
        f"Coordinator-side handler time over the same rounds (its `pagedkv_coordinator_rpc_latency_seconds`): "
        f"Open mean {h['Open'].get('mean_ms', float('nan')):.3f} ms, Close mean {h['Close'].get('mean_ms', float('nan')):.3f} ms, "
        f"Lookup mean {h['Lookup'].get('mean_ms', float('nan')):.3f} ms.",
        "",
        f"Sequential open+close: {r['throughput']['sequential_open_close_per_s']:.0f}/s (1 thread)"
        + (
            f"; {r['throughput']['concurrent']['open_close_per_s']:.0f}/s with {r['throughput']['concurrent']['threads']} client threads."
            if r["throughput"]["concurrent"]
            else "."
        ),
        "",
        "## Redis commands per operation (counted: SLOWLOG at 0 us, every command logged)",
        "",
        "| op | commands / op | by command (per op) | server us / call (p50) | commandstats cross-check |",
        "|---|---:|---|---|---:|",
    ]
    for phase in ("open", "close", "open_before", "close_before"):
        if phase not in c:
            continue
        x = c[phase]
        by = ", ".join(f"{k} {v:g}" for k, v in x["per_op_by_command"].items())
        us = ", ".join(
            f"{k} {v['p50']:g}" for k, v in x["server_us_per_call"].items() if k in x["per_op_by_command"]
        )
        label = phase.replace("_before", f" (baseline, git {bg})")
        lines.append(
            f"| {label} | {x['per_op_total']:.2f} | {by} | {us} | {x['commandstats_per_op_minus_background']:.2f} |"
        )
    lines += [
        "",
        "Server-side time of the scripts (SLOWLOG, us, 100 calls each): "
        + ", ".join(
            f"{k} p50 {v['p50']:g} / p99 {v['p99']:g}" for k, v in c.get("match_script_server_us", {}).items()
        )
        + ".",
        "",
        "Commands run inside those scripts (not round trips; Redis is blocked meanwhile), per op: "
        + "; ".join(
            f"{ph}: " + ", ".join(f"{k} {v:g}" for k, v in c[ph]["commands_inside_scripts_per_op"].items())
            for ph in ("open", "close", "open_before")
            if ph in c
        )
        + ".",
        "",
        f"Background commands in the windows (heartbeats, reaper, node events), excluded: "
        f"open {c['open']['background_in_window']}, close {c['close']['background_in_window']}.",
        "",
        "## Goals",
        "",
        f"- Redis round trips per open <= 2: **{'met' if g['redis_round_trips_met'] else 'NOT met'}** "
        f"({g['redis_round_trips_per_open']:.2f}).",
        f"- open p50 <= 2x the no-op RPC p50: **{'met' if g['open_p50_met'] else 'NOT met'}** "
        f"(open p50 {lat['open']['p50_ms']:.3f} ms = {g['open_p50_over_noop_rpc_p50']:.2f}x the Health.Check p50 "
        f"{lat['coord_health']['p50_ms']:.3f} ms).",
        "",
    ]
    if bg:
        lines += [
            f"## Before / after, measured in the same rounds (before: coordinator at git {bg}; after: this code)",
            "",
            "| p50 ms | before | after | no-op RPC before / after | ratio before / after |",
            "|---|---:|---:|---:|---:|",
        ]
        hb, ha = lat["coord_health_before"]["p50_ms"], lat["coord_health"]["p50_ms"]
        for key in ("open", "open+append", "close", "lookup"):
            if f"{key}_before" not in lat:
                continue
            b_, a_ = lat[f"{key}_before"]["p50_ms"], lat[key]["p50_ms"]
            lines.append(
                f"| {key} | {b_:.3f} | {a_:.3f} | {hb:.3f} / {ha:.3f} | {b_ / hb:.2f}x / {a_ / ha:.2f}x |"
            )
        ob = c.get("open_before", {}).get("per_op_total", float("nan"))
        lines += [
            f"| Redis round trips per open | {ob:.2f} | {g['redis_round_trips_per_open']:.2f} | | |",
            "",
        ]
    prof = r.get("profile") or {}
    if "Open" in prof:
        lines += [
            f"## Where the coordinator's Open handler spends its wall time ({prof['tool']}, "
            f"{prof['open_close_ops']} open+close)",
            "",
            "| Open handler was in | share |",
            "|---|---:|",
        ]
        lines += [f"| {b['what']} | {b['share']:.1%} |" for b in prof["Open"]["breakdown"][:10]]
        lines += ["", "| Close handler was in | share |", "|---|---:|"]
        lines += [f"| {b['what']} | {b['share']:.1%} |" for b in prof["Close"]["breakdown"][:8]]
        lines.append("")
    elif prof:
        lines += [f"Profile: {prof.get('error')}", ""]
    if r.get("findings"):
        lines += ["## Findings", "", r["findings"], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
