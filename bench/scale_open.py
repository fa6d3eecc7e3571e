# ruff: noqa: E501  (report strings and table rows)
"""The open script's Redis time against the node count, side by side in one Redis (issue 24).

    python -m bench.scale_open                    # 2 / 100 / 1,000 nodes; 1k, 8k and 32k-token prompts
    python -m bench.scale_open --quick            # 2 and 40 nodes, one prompt: a smoke run

One redis-server holds one cluster per node count (each under its own prefix, registered
with varied room, load and recent opens, one node holding the whole prompt); the opens of
the same prompt (plus a unique block) go to each cluster in turn, each closed at once, so
every count sees the same load on this machine at the same moments. Redis time per open is
the open_sequence EVALSHA's SLOWLOG duration (0 us threshold); reported: its p50 per count
and prompt, and the ratio to the smallest count. bench.scale measures the same through real
coordinator processes and fake nodes, where the coordinator's own CPU shifts the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path

import redis

from pagedkv.coordinator.records import NewSequence, NodeRoom
from pagedkv.coordinator.redis_store import RedisStore

RESULTS = Path(__file__).parent / "results"
BLOCK = 16
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16", "block_size": BLOCK}


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a free port (no persistence); its URL once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench.scale_open needs redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"redis-server on port {port} did not answer") from None
            time.sleep(0.05)


def build(url: str, nodes: int, keys: list[bytes]) -> tuple[RedisStore, tuple[NodeRoom, ...]]:
    store = RedisStore(url, prefix=f"n{nodes}:")
    ids = [f"node-{i:04d}" for i in range(nodes)]
    for node_id in ids:
        store.register_node(node_id, f"{node_id}:1", SPEC, 4096, 600.0)
    store.apply_events(ids[nodes // 2], keys, [])
    rnd = random.Random(nodes)
    rooms = tuple(
        NodeRoom(i, 4000 - rnd.randrange(100), 4096, 0, rnd.random() * 3, rnd.randrange(50)) for i in ids
    )
    return store, rooms


def measure(url: str, counts: list[int], prompt_tokens: int, opens: int) -> dict[int, float]:
    r = redis.Redis.from_url(url)
    r.flushall()
    num_keys = prompt_tokens // BLOCK
    keys = [i.to_bytes(16, "big") for i in range(1, num_keys + 1)]
    setups = {n: build(url, n, keys) for n in counts}
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", 1_000_000)
    r.execute_command("SLOWLOG", "RESET")
    for j in range(opens):
        unique = (10**9 + j).to_bytes(16, "big")
        for n in counts:
            store, rooms = setups[n]
            new = NewSequence(
                f"s{j}", "acme", (num_keys + 1) * BLOCK, num_keys + 1, BLOCK, b"".join(keys) + unique, rooms,
                pending_ttl_ms=0,
            )  # fmt: skip
            store.open_sequence(new)
            store.delete_sequence(f"s{j}")
    by: dict[int, list[int]] = {n: [] for n in counts}
    for e in r.execute_command("SLOWLOG", "GET", -1):
        args, duration = e[3], e[2]
        if args[0] == b"EVALSHA" and len(args) > 10:  # the open (a close has 3 arguments)
            by[int(args[3].split(b":")[0][1:])].append(duration)
    for store, _ in setups.values():
        store.close()
    r.close()
    return {n: float(statistics.median(v)) for n, v in by.items()}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scale_open", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 and 40 nodes, one 1k prompt, 30 opens")
    p.add_argument("--url", default="", help="an empty Redis to use (default: start one)")
    p.add_argument("--opens", type=int, default=300)
    p.add_argument("--out", default=str(RESULTS / "scale_open"), help="output path without extension")
    args = p.parse_args()
    counts, prompts = ([2, 40], [1024]) if args.quick else ([2, 100, 1000], [1024, 8192, 32768])
    opens = 30 if args.quick else args.opens
    server = None
    url = args.url
    if not url:
        server, url = start_redis()
    try:
        rows = {}
        for tokens in prompts:
            rows[tokens] = measure(url, counts, tokens, opens)
            print(f"[scale_open {time.strftime('%H:%M:%S')}] {tokens} tokens: {rows[tokens]}", flush=True)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    load = os.getloadavg()[0]
    lines = [
        f"Open script Redis time (SLOWLOG p50, us), {opens} opens per cell, interleaved; load {load:.1f} on {os.cpu_count()} CPUs",
        "",
        "| prompt | "
        + " | ".join(f"{n} nodes" for n in counts)
        + " | "
        + " | ".join(f"{n} / {counts[0]}" for n in counts[1:])
        + " |",
        "|---|" + "---|" * (2 * len(counts) - 1),
    ]
    for tokens, p50 in rows.items():
        ratios = " | ".join(f"{p50[n] / p50[counts[0]]:.2f}x" for n in counts[1:])
        lines.append(f"| {tokens} | " + " | ".join(f"{p50[n]:.0f}" for n in counts) + f" | {ratios} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"load": load, "opens": opens, "p50_us": rows}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
