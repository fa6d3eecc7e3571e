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
import importlib.metadata as md
import json
import os
import platform
import random
import subprocess
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.control_profile import profile_coordinator
from bench.control_redis import MATCH_ARGS, count_commands, hist_delta, scrape_handler_hist
from bench.control_report import findings, render
from bench.control_setup import (
    N_SYSTEM,
    NODE,
    PREFIX,
    SUFFIX_LEN,
    SYSTEM_LEN,
    TENANT,
    BenchCluster,
    log,
    pcts,
    previous_token_list,
    w2_requests,
    with_previous_token_lists,
)
from bench.revisions import import_root
from pagedkv.client import channels
from pagedkv.client.config import ClientConfig
from pagedkv.client.sync import CacheClient
from pagedkv.cluster import free_port
from pagedkv.coordinator.records import NewSequence, NodeRoom
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos.keys import chain_keys, root_key
from pagedkv.protos.spec import ModelSpec

RESULTS = Path(__file__).resolve().parent / "results"


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

    # No cluster secret: the node Open + Free hop is called directly, as the coordinator would
    cluster = BenchCluster(num_nodes=2, node=NODE, use_redis=True, secure=False)
    cluster.metrics_port = free_port()
    log("starting redis-server + coordinator + 2 nodes ...")
    with cluster:
        log("cluster up:\n" + cluster.describe())
        assert cluster.redis_url, "redis-server is not on the PATH: this benchmark needs Redis"
        cluster.current_address = cluster.start_replica("coordinator-current", None, cluster.metrics_port)
        log(f"measured coordinator (this code) at {cluster.current_address}")
        baseline_git = ""
        if args.baseline_rev:
            root, baseline_git = import_root(args.baseline_rev)
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
    # the same code with the coordinator sending the node Open (the default before fe0b7a3)
    coord_opens = CacheClient(
        coordinator=cluster.current_address, spec=spec, config=ClientConfig(worker_opens=False)
    )
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

    def v_open_close_coord(p: list[int]) -> dict[str, float]:
        sid = f"oo-{next(it)}"
        t0 = time.perf_counter()
        seq = coord_opens.open(sid, p)
        t1 = time.perf_counter()
        seq.close()
        return {"open_coord": t1 - t0, "close_coord": time.perf_counter() - t1}

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
        # The holder of the system prompt, unless a product open of this same prompt (another
        # variant, moments ago) left an in-flight marker promising more of it elsewhere.
        assert placement.cached_tokens == SYSTEM_LEN or placement.pending_blocks > SYSTEM_LEN // bs, placement
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
        v_open_close_coord,
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
    openers = {"open": lambda: client.open(f"cnt-{next(it)}", next(pi))}
    if base is not None:
        openers["open_before"] = lambda: base.open(f"cnt-{next(it)}", next(pi))
    counts = count_commands(
        r, me_addr, args.count_ops, openers, [v_match, v_match_args, v_seq_scripts], prompts
    )

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
    profile = profile_coordinator(
        cluster.procs["coordinator-current"].pid,
        cluster.log_dir,
        args.out,
        args.profile_s,
        lambda i: v_open_close(prompts[i % len(prompts)]),  # prompts reused: the W2 list can run out
    )

    redis_info = r.info("server")
    store.close()
    r_cand.close()
    client.close()
    coord_opens.close()
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


if __name__ == "__main__":
    main()
