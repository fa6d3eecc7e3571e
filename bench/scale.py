# ruff: noqa: E501  (report strings and table rows)
"""The control plane at scale (issue 24): opens, events and membership against node count,
prompt length, index size and coordinator replicas, on a real loopback cluster.

    python -m bench.scale            # 2 / 100 / 1,000 nodes, prompts 1k-32k, index 10^4-10^5 (~5 min)
    python -m bench.scale --big      # + 128k prompts and a 10^6-key index (longer, ~3 GB of Redis)
    python -m bench.scale --quick    # 2 and 20 nodes, one prompt: a smoke run (tests/bench)
    python -m bench.scale --pin      # the coordinators on CPU 0, the rest on the others

Each point starts a fresh redis-server, 1 or 2 real `pagedkv coordinator` processes and
N fake nodes (bench/scale_cluster.py: real Register / Heartbeat / ReportEvents rpcs,
a stub data plane). One node holds the prompt (ReportEvents); the index holds
`--index` further keys spread over every node. Then, per prompt length, opens of the
prompt plus a unique block (a hit of the whole prompt) each followed by its close,
one at a time, through the coordinators in turn (placement's balance bound sends
some of them to other nodes: the hit share is reported). Reported:

- register: seconds for N registrations (64 in flight); nodes reaped and beats
  answered "not registered" over the whole point (none should be: every node beats);
- open: the rpc's p50 / p99 (open and close, ms) as the bench process sees it; closes
  answered UNAVAILABLE (a node whose beat was late is a suspect) are retried and counted;
- Redis time per script (SLOWLOG at a 0 us threshold: every command with its server
  time) for open_sequence and delete_sequence, p50 (us);
- CPU per open + close: the coordinators' (/proc, user + system) and Redis's (INFO cpu),
  less what the same processes spent over as long a quiet window (heartbeats: also
  reported, per beat), and the coordinators' raw figure;
- saturated: `--clients` processes (default 2, then 8: a window each) open and close as fast as they are answered
  for `--throughput-s` seconds while every node beats (bench/scale_throughput.py): open+close
  per second, the coordinators' cores (beats included) and opens per second per core;
- events: coordinator CPU per event at batch 1 and at batch 256 (numbered, as a node's link
  sends them, until the store holds them all), and the apply_event_runs script's Redis time
  per script (a flush's runs, several to a script).

Writes bench/results/scale.{json,md} and scale.png (open Redis time against node count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench import plots
from bench.control_redis import script_names, slowlog_entries
from bench.scale_cluster import SPEC, FakeNodes, ScaleCluster, cpu_s, thread_cpu_s
from bench.scale_throughput import measure_throughput
from pagedkv.client.routing import FRAMED_REPLIES
from pagedkv.client.sent_prompts import SentPrompts
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import Unavailable
from pagedkv.protos.framed_client import FramedPort
from pagedkv.protos.keys import chain_keys, root_key
from pagedkv.protos.prompt import PACKED_TOKEN_BYTES, pack

RESULTS = Path(__file__).parent / "results"
BLOCK = SPEC.block_size


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def python_loop_s(steps: int = 10**7) -> float:
    """Seconds of an empty `steps`-step Python loop at module level (as `python -c` runs it,
    the figure bench/README quotes): the host's interpreter speed, which the per-core figures
    follow (0.23 s to 1.8 s on the VMs these ran on)."""
    start = time.perf_counter()
    exec(f"for i in range({steps}): pass", {})  # (a dict namespace, as a module's)
    return time.perf_counter() - start


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q)) if samples else float("nan")


def fill_index(url: str, node_ids: list[str], num_keys: int, seed: int) -> float:
    """num_keys random keys spread over the nodes, written straight to the store (the
    index's size is the point, not how it got there); returns the seconds it took."""
    rng = np.random.default_rng(seed)
    store = RedisStore(url)
    start = time.perf_counter()
    per_node = max(1, num_keys // len(node_ids))
    left = num_keys
    for node_id in node_ids:
        n = min(per_node, left)
        if n <= 0:
            break
        raw = rng.bytes(16 * n)
        keys = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        for first in range(0, n, 20_000):
            store.apply_events(node_id, keys[first : first + 20_000], [])
        left -= n
    store.close()
    return time.perf_counter() - start


class Window:
    """CPU of the coordinators and Redis over a span, less the quiet rate measured before."""

    def __init__(self, cluster: ScaleCluster) -> None:
        self.cluster = cluster
        self.quiet_coord_s_per_s = 0.0
        self.quiet_redis_s_per_s = 0.0

    def sample(self) -> tuple[float, float, float]:
        coord = sum(cpu_s(p) for p in self.cluster.coordinator_pids())
        return time.perf_counter(), coord, self.cluster.redis_cpu_s()

    def measure_quiet(self, seconds: float) -> None:
        t0, c0, r0 = self.sample()
        time.sleep(seconds)
        t1, c1, r1 = self.sample()
        self.quiet_coord_s_per_s = (c1 - c0) / (t1 - t0)
        self.quiet_redis_s_per_s = (r1 - r0) / (t1 - t0)

    def since(self, start: tuple[float, float, float]) -> tuple[float, float, float]:
        """(coordinator CPU s, the same with the quiet rate taken out, Redis CPU s less its
        quiet rate) since `start`."""
        t1, c1, r1 = self.sample()
        dt = t1 - start[0]
        return (
            c1 - start[1],
            max(0.0, c1 - start[1] - self.quiet_coord_s_per_s * dt),
            max(0.0, r1 - start[2] - self.quiet_redis_s_per_s * dt),
        )


def script_us(cluster: ScaleCluster, names: dict[str, str]) -> dict[str, list[int]]:
    """Server time (us) of every EVALSHA since the last SLOWLOG RESET, by script name."""
    me = cluster.redis.client_info()["addr"]
    out: dict[str, list[int]] = defaultdict(list)
    for e in slowlog_entries(cluster.redis, me, names):
        if not e["in_script"] and e["name"].startswith("evalsha:"):
            out[e["name"].split(":", 1)[1]].append(e["us"])
    cluster.redis.execute_command("SLOWLOG", "RESET")
    return out


def coordinator_call(stub: Any, framed: FramedPort | None, method: str, request: Any) -> Any:
    """`method` on the coordinator's framed port when `framed` (learning the port from the
    first gRPC reply, as CacheClient does), else over gRPC."""
    if framed is not None and framed.is_usable:
        return framed.call(method, request, FRAMED_REPLIES[method], 60)
    reply = getattr(stub, method)(request, timeout=60)
    if framed is not None and method == "Open":
        framed.learn(reply.frame_port)
    return reply


def close_retrying(stub: Any, seq_id: str, freed_extents: int = 0, framed: FramedPort | None = None) -> int:
    """Close as a worker does: an UNAVAILABLE answer (the sequence's node is a suspect, its
    beat late on an overloaded host) is retried after a pause. Returns the retries.
    freed_extents: as a client's close sends it once it freed the sequence on its node
    itself (client/closing.py; the stub nodes hold nothing to free): no node Free from the
    coordinator; 0: the coordinator sends it, as an older client's close has it do."""
    request = pb.CoordSeqRequest(seq_id=seq_id, freed_extents=freed_extents)
    for retries in range(100):
        try:
            coordinator_call(stub, framed, "Close", request)
            return retries
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        except Unavailable:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"close of {seq_id} still UNAVAILABLE after 100 tries")


# Who sends the node Open (CoordOpenRequest.worker_opens), how Open and Close travel and how
# the prompt does: the coordinator (gRPC), the worker (gRPC), the worker over the coordinator's
# framed port with the prompt as varints in the signed order, and as the client sends it now:
# packed, the order naming it and the worker carrying its cached prefix (carries_prompt), and
# the same with the start it shares with the last prompt named by that open's ref (prefix_ref).
MODES = ("coordinator", "worker", "framed_varints", "framed", "framed_ref")
MODE_NAMES = {
    "coordinator": "gRPC, node Open by the coordinator",
    "worker": "gRPC, node Open by the worker",
    "framed_varints": "framed port, node Open by the worker, prompt in the order",
    "framed": "framed port, node Open by the worker, prompt packed and carried",
    "framed_ref": "as above, its start named by the last prompt's ref",
}


def measure_opens(
    cluster: ScaleCluster,
    window: Window,
    names: dict[str, str],
    prompt: list[int],
    num_opens: int,
    tag: str,
    rounds: int = 4,
    freed_extents: int = 0,
) -> dict[str, dict[str, Any]]:
    """Opens and closes of the prompt in each mode, the modes alternating in `rounds`
    rounds so that load drifts hit both alike; each mode's figures over all its rounds."""
    acc: dict[str, dict[str, Any]] = {
        m: {
            "open_ms": [],
            "close_ms": [],
            "hits": 0,
            "named": 0,
            "unavailable": 0,
            "raw_s": 0.0,
            "coord_s": 0.0,
        }
        | {"redis_s": 0.0, "threads": {}, "scripts": {}, "n": 0, "first_n": 0}
        for m in MODES
    }
    per_round = max(1, num_opens // rounds)
    framed_ports = [FramedPort("127.0.0.1", None, None) for _ in cluster.stubs]
    sent = [SentPrompts() for _ in cluster.stubs]  # what framed_ref names, per coordinator
    for _ in range(rounds):
        for mode in MODES:
            a = acc[mode]
            cluster.redis.execute_command("SLOWLOG", "RESET")
            first = cluster.coordinator_pids()[0]
            start = window.sample()
            threads0 = thread_cpu_s(first)  # after the whole at the start, before it at the end
            for i in range(per_round):
                n = a["n"] + i
                stub = cluster.stubs[n % len(cluster.stubs)]
                a["first_n"] += n % len(cluster.stubs) == 0
                tokens = prompt + [1_000_000 + n] * BLOCK + [7]  # a unique block after the shared prompt
                seq_id = f"{tag}-{mode}-{n}"
                t0 = time.perf_counter()
                worker = mode != "coordinator"
                carried = pack(tokens) if mode in ("framed", "framed_ref") else None  # as the client packs
                if carried is not None:
                    req = pb.CoordOpenRequest(seq_id=seq_id, packed_token_ids=carried, worker_opens=True)
                    req.carries_prompt = True
                    if mode == "framed_ref":  # as the client names a start it sent (client/sent_prompts.py)
                        a["named"] += sent[n % len(cluster.stubs)].fill(req, carried) > 0
                else:
                    req = pb.CoordOpenRequest(seq_id=seq_id, token_ids=tokens, worker_opens=worker)
                framed = framed_ports[n % len(cluster.stubs)] if mode.startswith("framed") else None
                reply = coordinator_call(stub, framed, "Open", req)
                if mode == "framed_ref":
                    sent[n % len(cluster.stubs)].learn(carried, reply)
                if carried is not None:  # the cached prefix rides beside the order
                    reply.node_open.packed_token_ids = carried[: PACKED_TOKEN_BYTES * reply.num_cached_tokens]
                if worker:  # as CacheClient does: the node Open, then open() returns
                    cluster.stub_node.OpenSigned(reply.node_open, timeout=60)
                t1 = time.perf_counter()
                a["unavailable"] += close_retrying(stub, seq_id, freed_extents, framed)
                t2 = time.perf_counter()
                a["open_ms"].append((t1 - t0) * 1e3)
                a["close_ms"].append((t2 - t1) * 1e3)
                a["hits"] += reply.num_cached_tokens == len(prompt)
            threads1 = thread_cpu_s(first)
            raw_s, coord_s, redis_s = window.since(start)
            a["raw_s"] += raw_s
            a["coord_s"] += coord_s
            a["redis_s"] += redis_s
            a["n"] += per_round
            for k, v in threads1.items():
                a["threads"][k] = a["threads"].get(k, 0.0) + v - threads0.get(k, 0.0)
            for k, v in script_us(cluster, names).items():
                a["scripts"].setdefault(k, []).extend(v)
    out = {}
    for mode, a in acc.items():
        n, us = a["n"], a["scripts"]
        out[mode] = {
            "opens": n,
            "hit_share": a["hits"] / n,
            "named_share": a["named"] / n,  # opens whose start went as a ref
            "open_p50_ms": pct(a["open_ms"], 50),
            "open_p99_ms": pct(a["open_ms"], 99),
            "close_p50_ms": pct(a["close_ms"], 50),
            "closes_unavailable": a["unavailable"],
            "open_script_p50_us": pct(us.get("open_seq", []), 50),
            "open_script_max_us": max(us.get("open_seq", [0])),
            "delete_script_p50_us": pct(us.get("delete_seq", []), 50),
            "coord_cpu_per_open_close_ms": a["coord_s"] / n * 1e3,
            "coord_cpu_raw_per_open_close_ms": a["raw_s"] / n * 1e3,  # heartbeats meanwhile included
            "redis_cpu_per_open_close_ms": a["redis_s"] / n * 1e3,
            # the first coordinator's CPU by thread role (beats included), per open+close it served
            "coord_thread_ms": {
                k: v / max(1, a["first_n"]) * 1e3 for k, v in sorted(a["threads"].items()) if v > 0
            },
        }
    return out


def measure_events(
    cluster: ScaleCluster, nodes: FakeNodes, window: Window, names: dict[str, str], seed: int
) -> dict[str, Any]:
    """Coordinator CPU per event at batch 1 (4,000 rpcs) and batch 256 (32 rpcs of fresh keys:
    enough events that the CPU clock's 10 ms tick is a few us of one),
    one-way on the framed port (as nodes send them), as framed calls, and over gRPC,
    alternating in 2 rounds."""
    rng = np.random.default_rng(seed)
    acc: dict[str, list[float]] = defaultdict(list)
    for _ in range(2):
        for way in ("", "_twoway", "_grpc"):
            for batch, rpcs in ((1, 2000), (256, 16)):
                raw = rng.bytes(16 * batch * rpcs)
                keys = [raw[i : i + 16] for i in range(0, len(raw), 16)]
                cluster.redis.execute_command("SLOWLOG", "RESET")
                start = window.sample()
                nodes.report(len(nodes.ids) - 1, keys, batch, framed=way == "_twoway", one_way=not way)
                _, coord_s, _ = window.since(start)
                tag = f"batch{batch}{way}"
                acc[f"{tag}_coord_cpu_per_event_us"].append(coord_s / len(keys) * 1e6)
                acc[f"{tag}_apply_events_p50_us"].append(
                    pct(script_us(cluster, names).get("apply_event_runs", []), 50)  # numbered reports
                )
    return {k: float(np.mean(v)) for k, v in acc.items()}


def run_point(
    args: argparse.Namespace, num_nodes: int, coordinators: int, index: int, prompts: list[int]
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="pagedkv-scale-"))
    extra = ["--max-beats-per-s", args.max_beats_per_s] if args.max_beats_per_s else []
    cluster = ScaleCluster(
        workdir, coordinators, args.lease_ttl_s, extra, coordinator_cpus=[0] if args.pin else []
    )
    nodes = FakeNodes(cluster, num_nodes)
    nodes.beat_framed = not args.grpc_beats
    nodes.beats_spread = not args.burst_beats
    point: dict[str, Any] = {"nodes": num_nodes, "coordinators": coordinators, "index_keys": index}
    try:
        names = script_names()
        cluster.redis.config_set("slowlog-log-slower-than", 0)
        cluster.redis.config_set("slowlog-max-len", 1_000_000)
        point["register_s"] = nodes.register(beat=True)
        log(f"{num_nodes} nodes x {coordinators} coordinators: registered in {point['register_s']:.2f} s")
        point["index_fill_s"] = fill_index(cluster.redis_url, nodes.ids, index, args.seed)
        nodes.first_round.wait(60)  # (the quiet window counts beats, not links connecting)
        window = Window(cluster)
        window.measure_quiet(args.quiet_s)
        point["quiet_coord_cpu_per_s"] = window.quiet_coord_s_per_s
        point["coord_cpu_per_beat_us"] = window.quiet_coord_s_per_s / (num_nodes / nodes.interval_s) * 1e6
        point["lease_s"] = max(nodes.leases)  # as handed out once every node beat on it
        point["beats_per_s"] = num_nodes / nodes.interval_s
        log(
            f"  lease {point['lease_s']:g} s: {point['beats_per_s']:.0f} beats/s, {point['coord_cpu_per_beat_us']:.0f} us each"
        )
        salt = RedisStore(cluster.redis_url).tenant_salt("default")  # the coordinator's, SET NX
        rng = np.random.default_rng(args.seed)
        point["prompts"] = {}
        for tokens in prompts:
            prompt = rng.integers(0, 50_000, tokens).tolist()
            nodes.report(0, chain_keys(root_key(salt), prompt, BLOCK), 4096)
            num_opens = max(10, min(args.opens, args.opens * 8192 // tokens))
            freed = 0 if args.coordinator_frees else 1
            both = measure_opens(cluster, window, names, prompt, num_opens, f"p{tokens}", freed_extents=freed)
            point["prompts"][tokens] = both["framed_ref"]  # the client's default
            for clients in args.clients:
                sat = measure_throughput(
                    cluster,
                    nodes.frame_ports,
                    prompt,
                    clients,
                    args.throughput_s,
                    f"t{tokens}-{clients}",
                    args.client_lists,
                    args.whole_prompts,
                )
                point["prompts"][tokens].setdefault("saturated_by_clients", []).append(sat)
                log(
                    f"  prompt {tokens:>6}, {clients} clients: {sat['open_close_per_s']:.0f} open+close/s on "
                    f"{sat['coord_cores']:.2f} coordinator cores: {sat['opens_per_s_per_core']:.0f} a core"
                )
            for mode, result in both.items():
                point.setdefault("prompts_by_mode", {}).setdefault(mode, {})[tokens] = result
                log(
                    f"  prompt {tokens:>6}, {MODE_NAMES[mode]}: open p50 "
                    f"{result['open_p50_ms']:.2f} ms, script p50 {result['open_script_p50_us']:.0f} us, "
                    f"coordinator CPU/open+close {result['coord_cpu_per_open_close_ms']:.2f} ms"
                )
        point["events"] = measure_events(cluster, nodes, window, names, args.seed + 1)
        log(f"  events: {point['events']}")
        counters = [cluster.counters(i) for i in range(coordinators)]
        point["nodes_reaped"] = sum(c.get("nodes_reaped", 0) for c in counters)
        point["reaps_held"] = sum(c.get("reaps_held", 0) for c in counters)
        point["late_beat_rounds"] = nodes.late_beats
        point["beats_unregistered"] = nodes.unregistered
        point["reports_lapsed"] = nodes.lapsed_reports
        point["beats_failed"] = nodes.failed_beats
        point["redis_used_memory_mb"] = cluster.redis.info("memory")["used_memory"] / 2**20
    finally:
        nodes.stop()
        cluster.stop()
    return point


def render(r: dict[str, Any]) -> str:
    lines = [
        f"# bench.scale ({r['mode']}), {r['host']}",
        "",
        *(
            [
                f"A 10^7-step Python loop took {' / '.join(f'{x:.2f}' for x in r['python_loop_s'])} s "
                "(start / end): the per-core figures follow it.",
                "",
            ]
            if "python_loop_s" in r
            else []
        ),
        "| nodes | coords | index | prompt | hit share | open p50 / p99 ms | open script p50 us | delete script p50 us | coord CPU / open+close ms (raw) | Redis CPU / open+close ms | closes retried |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        for tokens, o in p["prompts"].items():
            lines.append(
                f"| {p['nodes']} | {p['coordinators']} | {p['index_keys']:,} | {int(tokens):,} | "
                f"{o['hit_share']:.2f} | {o['open_p50_ms']:.2f} / {o['open_p99_ms']:.2f} | "
                f"{o['open_script_p50_us']:.0f} | {o['delete_script_p50_us']:.0f} | "
                f"{o['coord_cpu_per_open_close_ms']:.2f} ({o['coord_cpu_raw_per_open_close_ms']:.2f}) | "
                f"{o['redis_cpu_per_open_close_ms']:.3f} | {o.get('closes_unavailable', 0)} |"
            )
    lines += [
        "",
        "Saturated: client processes opening and closing back to back; the coordinators' cores over the",
        "window include the beats; opens/s per core = open+close per second / those cores.",
        "",
        "| nodes | coords | prompt | clients | open+close /s | coord cores | opens/s per core | CPU / open+close ms (beats in) | closes retried |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        for tokens, o in p["prompts"].items():
            for t in o.get("saturated_by_clients", []):
                lines.append(
                    f"| {p['nodes']} | {p['coordinators']} | {int(tokens):,} | {t['clients']} | "
                    f"{t['open_close_per_s']:.0f} | {t['coord_cores']:.2f} | **{t['opens_per_s_per_core']:.0f}** | "
                    f"{t['coord_cpu_per_open_close_ms']:.2f} | {t['retried']} |"
                )
    lines += [
        "",
        "How Open and Close travel, who sends the node Open and how the prompt goes (rounds alternating):",
        "the framed port, the worker's node Open, the prompt packed and named by the order (the client's",
        "default, above); the same with the prompt as varints held by the signed order; gRPC, the",
        "worker's node Open; gRPC, the coordinator's.",
        "CPU by thread is the first coordinator's per open+close it served (ms, beats included).",
        "",
        "| nodes | coords | prompt | Open and Close | coord CPU / open+close ms | open p50 ms | by thread |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        for mode, by_prompt in p.get("prompts_by_mode", {}).items():
            for tokens, o in by_prompt.items():
                split = ", ".join(f"{k} {v:.2f}" for k, v in o.get("coord_thread_ms", {}).items())
                lines.append(
                    f"| {p['nodes']} | {p['coordinators']} | {int(tokens):,} | {MODE_NAMES[mode]} | "
                    f"{o['coord_cpu_per_open_close_ms']:.2f} | {o['open_p50_ms']:.2f} | {split} |"
                )
    lines += [
        "",
        "Events one-way on the framed port (as nodes send them); framed calls' / gRPC's in brackets.",
        "",
        "| nodes | coords | register s | reaped | held reaps | beats refused | lease s (beats/s) | coord cores, quiet | coord CPU / beat us | coord CPU / event, batch 1 us | batch 256 us | apply_event_runs p50 us, batch 1 / 256 | Redis MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        e = p["events"]
        lines.append(
            f"| {p['nodes']} | {p['coordinators']} | {p['register_s']:.2f} | {p['nodes_reaped']} | "
            f"{p['reaps_held']} | {p['beats_unregistered']} | {p.get('lease_s', 0):g} ({p.get('beats_per_s', 0):.0f}) | {p['quiet_coord_cpu_per_s']:.3f} | "
            f"{p['coord_cpu_per_beat_us']:.0f} | "
            f"{e['batch1_coord_cpu_per_event_us']:.0f} ({e.get('batch1_twoway_coord_cpu_per_event_us', 0):.0f} / "
            f"{e.get('batch1_grpc_coord_cpu_per_event_us', 0):.0f}) | "
            f"{e['batch256_coord_cpu_per_event_us']:.1f} ({e.get('batch256_twoway_coord_cpu_per_event_us', 0):.1f} / "
            f"{e.get('batch256_grpc_coord_cpu_per_event_us', 0):.1f}) | "
            f"{e['batch1_apply_events_p50_us']:.0f} / "
            f"{e['batch256_apply_events_p50_us']:.0f} | {p['redis_used_memory_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> bool:
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for p in r["points"]:
        if p["coordinators"] == 1 and p["index_keys"] == r["points"][0]["index_keys"]:
            for tokens, o in p["prompts"].items():
                series[int(tokens)].append((p["nodes"], o["open_script_p50_us"]))
    for tokens, pts in sorted(series.items()):
        pts.sort()
        ax.plot([n for n, _ in pts], [us for _, us in pts], marker="o", label=f"{tokens:,} tokens")
    ax.set_xscale("log")
    ax.set_xlabel("live nodes")
    ax.set_ylabel("open_sequence script, p50 (us of Redis)")
    ax.set_title("Open cost against node count")
    ax.legend()
    plots.save(fig, path)
    return True


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 and 20 nodes, one 2k prompt: a smoke run")
    p.add_argument("--big", action="store_true", help="add 128k-token prompts and a 10^6-key index")
    p.add_argument("--nodes", default="2,100,1000", help="node counts (comma-separated)")
    p.add_argument("--opens", type=int, default=200, help="opens per point at 8k tokens (fewer for longer)")
    p.add_argument("--lease-ttl-s", type=float, default=3.0, help="the coordinators' configured lease")
    p.add_argument(
        "--max-beats-per-s",
        default="",
        help="the coordinators' --max-beats-per-s (default: theirs, 500: the lease doubles while the "
        "fleet's beats would pass it; 0: a fixed lease, beats every quarter of --lease-ttl-s)",
    )
    p.add_argument("--quiet-s", type=float, default=2.0, help="the quiet window (heartbeats only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--coordinator-frees",
        action="store_true",
        help="closes as an older client's: the coordinator sends the node Free (default: the worker did)",
    )
    p.add_argument(
        "--grpc-beats",
        action="store_true",
        help="the fake nodes beat over gRPC (default: on the coordinator's framed port, as nodes do)",
    )
    p.add_argument(
        "--burst-beats",
        action="store_true",
        help="every node beats at the start of each interval, back to back (before 2026-12: the "
        "default; now each node beats at its own moment of the interval, as nodes on their own timers)",
    )
    p.add_argument(
        "--clients",
        type=lambda v: [int(x) for x in v.split(",") if x and x != "0"],
        default=[2, 8],
        help="client processes for the saturated opens after the sequential ones, one window per "
        "count (comma-separated; 0: none)",
    )
    p.add_argument("--throughput-s", type=float, default=5.0, help="the saturated opens' window")
    p.add_argument(
        "--client-lists",
        action="store_true",
        help="the saturated clients send each prompt as a Python list (before 2026-12-07; now an "
        "int64 array, whose packing costs a 32k open ~0.2 ms of client CPU instead of ~1.5)",
    )
    p.add_argument(
        "--whole-prompts",
        action="store_true",
        help="the saturated clients send every prompt whole (before 2026-12-08; now as the client "
        "does: the start it shares with the last prompt named by that prompt's ref)",
    )
    p.add_argument("--prompts", default="", help="prompt lengths in tokens (default 1024,8192,32768)")
    p.add_argument("--indexes", default="", help="index sizes in keys (default 10000,100000)")
    p.add_argument("--replicas", default="", help="coordinator counts (default 1,2)")
    p.add_argument(
        "--pin",
        action="store_true",
        help="the coordinators on CPU 0 and everything else (Redis, the fake nodes, the clients) on "
        "the other CPUs, as a deployment gives a coordinator cores of its own (default: shared)",
    )
    p.add_argument("--out", default=str(RESULTS / "scale"), help="output path without extension")
    args = p.parse_args()
    if args.pin:
        others = set(range(1, os.cpu_count() or 1))
        if not others or not shutil.which("taskset"):
            p.error("--pin needs at least 2 CPUs and taskset (util-linux)")
        os.sched_setaffinity(0, others)  # before any thread or child: all of them inherit it
    if args.quick:
        node_counts, prompts, indexes, replicas = [2, 20], [2048], [10_000], [1]
        args.opens, args.quiet_s, args.throughput_s = 20, 0.5, 1.0
        args.clients = args.clients[:1]
    else:
        node_counts = [int(n) for n in args.nodes.split(",")]
        prompts = [1024, 8192, 32768] + ([131072] if args.big else [])
        indexes = [10_000, 100_000] + ([1_000_000] if args.big else [])
        replicas = [1, 2]
    if args.prompts:
        prompts = [int(n) for n in args.prompts.split(",")]
    if args.indexes:
        indexes = [int(n) for n in args.indexes.split(",")]
    if args.replicas:
        replicas = [int(n) for n in args.replicas.split(",")]
    loop_s = [python_loop_s()]
    points = []
    for n in node_counts:
        points.append(run_point(args, n, 1, indexes[0], prompts))
    for index in indexes[1:]:  # index size at the largest node count, one prompt length
        points.append(run_point(args, node_counts[-1], 1, index, [8192 if not args.quick else 2048]))
    for c in replicas[1:]:
        points.append(run_point(args, node_counts[-1], c, indexes[0], [8192]))
    result = {
        "mode": ("quick" if args.quick else ("big" if args.big else "default"))
        + (", pinned" if args.pin else ""),
        "pinned": args.pin,
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})",
        "python_loop_s": loop_s + [python_loop_s()],  # at the start and at the end
        "points": points,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(render(result))
    has_plot = plot(result, out.with_suffix(".png"))
    print(render(result))
    log(f"wrote {out}.json, .md" + (", .png" if has_plot else ""))


if __name__ == "__main__":
    main()
