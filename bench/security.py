"""What security costs on the data path: tickets on vs off, TLS vs plaintext, side by side.

    python -m bench.security          # ~2-3 min on CPU; writes bench/results/security.{json,md}
    python -m bench.security --quick  # fewer calls and one transfer repeat

One node process holds one engine (bench.rpc's shape: one layer, 8 KV heads, D 128, float32,
32 sequences of L = 2048 tokens) and serves it three times, each server with its own bulk
listener: `off` (no checks: a trusted network), `tickets` (a node serving a cluster: every data
call checked against the coordinator's tickets, minted here with the cluster secret) and
`tickets+tls` (the same over TLS: gRPC and the bulk TCP port). The same engine behind every
variant, so only the gate and the transport differ. The client (this process) presents the
tickets exactly as in a cluster: gRPC metadata per call, once per connection on the bulk channel.

Measured, variants interleaved call by call, medians:
- attend p50 at batch 1 and 32 (one layer, no new token) over each path a client takes: the
  same-host shared memory, the bulk TCP socket, gRPC -- tickets / off is the goal (<= 1.05);
  tickets+tls / tickets is TLS's price on the paths it covers;
- a 256 MiB KV upload (append) and download (read_kv into the caller's tensors) over TCP and
  gRPC, plaintext vs TLS, in GB/s;
- the same attends over sequences of SHORT_LEN = 64 tokens (an engine ~30x shorter): the
  transport's floor, where a per-call cost shows most (tickets / off, paired);
- the ticket check alone, in process (what each call adds on the node, and on the client),
  beside the attend it guards: the bound the end-to-end ratios cannot resolve on a noisy host.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch  # after bench/__init__.py, which sets pagedkv's process environment

from bench.rpc import (
    BATCHES,
    CONTEXT_LEN,
    NUM_Q_HEADS,
    RESULTS,
    SHORT_LEN,
    SMOKE_LEN,
    SPEC,
    TRANSFER_BYTES,
)

VARIANTS = ("off", "tickets", "tickets+tls")
PATHS = {"shm": ("shm", "grpc"), "tcp": ("tcp", "grpc"), "grpc": ("grpc",)}
TLS_PATHS = ("tcp", "grpc")  # (shared memory and the Unix socket never leave the host: no TLS)
SECRET = b"bench-cluster-secret-" + b"0123456789abcdef" * 2
NODE_ID, EPOCH, TENANT = "bench-node", 12345, "bench"
ROOT = Path(__file__).resolve().parents[1]


def _node(conn: Any, certs: str, context_len: int, transfer_bytes: int) -> None:
    """Child: the engine, its 32 sequences, three servers over it; then transfer
    resets on request until told to stop."""
    from pagedkv.cache_node.engine import CacheEngine, EngineConfig
    from pagedkv.cache_node.gate import NodeTrust
    from pagedkv.cache_node.server import create_server
    from pagedkv.protos.spec import ModelSpec
    from pagedkv.protos.tickets import ClusterKeys
    from pagedkv.protos.tls import TlsConfig

    spec = ModelSpec(**SPEC)
    seqs = max(BATCHES)
    xfer_blocks = transfer_bytes // spec.bytes_per_block + 2
    blocks = seqs * (context_len + SHORT_LEN) // spec.block_size + xfer_blocks + 16
    engine = CacheEngine(EngineConfig(spec, blocks, device="cpu"))
    g = torch.Generator().manual_seed(0)
    for prefix, length, first in (("s", context_len, 0), ("c", SHORT_LEN, 500_000)):
        shape = (1, length, spec.num_kv_heads, spec.head_dim)
        for i in range(seqs):
            toks = list(range(i * 10**6 + first, i * 10**6 + first + length))  # distinct: no sharing
            engine.open(f"{prefix}{i}", toks)
            engine.append(
                f"{prefix}{i}", toks, torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            )
    engine.open("x", [1])
    trust = NodeTrust(ClusterKeys([SECRET]), "", NODE_ID)
    tls = TlsConfig(f"{certs}/tls.crt", f"{certs}/tls.key", f"{certs}/ca.crt")
    servers, ports = [], {}
    for name, kw in (
        ("off", {}),
        ("tickets", {"trust": trust}),
        ("tickets+tls", {"trust": trust, "tls": tls}),
    ):
        server, port = create_server(engine, "127.0.0.1:0", **kw)  # type: ignore[arg-type]
        server.gate.set_registration(NODE_ID, EPOCH)
        servers.append(server.start())
        ports[name] = port
    conn.send(ports)
    while (cmd := conn.recv()) != "stop":
        if cmd == "reset":  # a fresh empty "x" for the next upload
            engine.free("x")
            engine.open("x", [1])
            conn.send("ok")
    for server in servers:
        server.stop(0)


def _certs(tmp: str) -> str:
    if shutil.which("openssl") is None:
        raise SystemExit("bench.security needs openssl for its TLS certificates")
    subprocess.run(
        ["sh", str(ROOT / "deploy" / "tls" / "make-certs.sh"), tmp, "localhost", "127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return tmp


def _client(variant: str, port: int, transports: tuple[str, ...], certs: str, seq_ids: list[str]) -> Any:
    from pagedkv.client import CacheClient
    from pagedkv.client.config import ClientConfig
    from pagedkv.protos.tickets import RIGHT_DATA, ClusterKeys, Ticket, issue
    from pagedkv.protos.tls import TlsConfig

    tls = TlsConfig(ca_file=f"{certs}/ca.crt") if variant == "tickets+tls" else None
    c = CacheClient(f"127.0.0.1:{port}", ClientConfig(transports=transports, tls=tls, bulk_min_bytes=0))
    if variant != "off":
        keys = ClusterKeys([SECRET])
        wallet = c.node(f"127.0.0.1:{port}").wallet
        expires = int(time.time()) + 3600
        for s in seq_ids:
            wallet.add(s, s, issue(keys, Ticket(RIGHT_DATA, expires, EPOCH, TENANT, s, NODE_ID)))
    c.connect()
    return c


def _attends(ports: dict[str, int], certs: str, divisor: int) -> dict[str, Any]:
    n = max(BATCHES)
    all_ids = [f"s{i}" for i in range(n)] + [f"c{i}" for i in range(n)]
    combos = [(v, p) for v in VARIANTS for p in PATHS if v != "tickets+tls" or p in TLS_PATHS]
    clients = {(v, p): _client(v, ports[v], PATHS[p], certs, all_ids) for v, p in combos}
    out: dict[str, Any] = {}
    rng = random.Random(0)
    runs = [
        ("", "s", combos, 300, 80),
        ("short/", "c", [k for k in combos if k[0] != "tickets+tls"], 600, 150),
    ]
    try:
        for tag, prefix, run, iters_1, iters_32 in runs:
            out.update(
                _attend_run(
                    clients, run, tag, [f"{prefix}{i}" for i in range(n)], iters_1, iters_32, divisor, rng
                )
            )
        for (v, p), c in clients.items():  # the tickets went once per connection, not per call
            link = c.node(next(iter(c._nodes))).data.bulk
            out[f"auth_round_trips/{p}/{v}"] = 0 if link is None else link.num_auth
    finally:
        for c in clients.values():
            c.close()
    return out


def _attend_run(
    clients: dict[tuple[str, str], Any],
    combos: list[tuple[str, str]],
    tag: str,
    ids: list[str],
    iters_1: int,
    iters_32: int,
    divisor: int,
    rng: random.Random,
) -> dict[str, Any]:
    """Attend p50 per (variant, path) and batch, the variants interleaved in a shuffled
    order each round; and each path's paired tickets / off ratio."""
    out: dict[str, Any] = {}
    for batch in BATCHES:
        iters = max(2, (iters_1 if batch == 1 else iters_32) // divisor)
        q = torch.randn(batch, NUM_Q_HEADS, SPEC["head_dim"])
        samples: dict[tuple[str, str], list[float]] = {k: [] for k in combos}
        for k in combos:  # warm every connection and its tickets
            clients[k].data.attend(ids[:batch], 0, q)
        for _ in range(iters):
            order = list(combos)
            rng.shuffle(order)
            for k in order:
                start = time.perf_counter()
                clients[k].data.attend(ids[:batch], 0, q)
                samples[k].append(time.perf_counter() - start)
        for (v, p), s in samples.items():
            out[f"{tag}b{batch}/{p}/{v}"] = {"p50_ms": statistics.median(s) * 1e3, "n": len(s)}
        # paired: each round's tickets call over its off call on the same path (the host's
        # drift between rounds cancels; what is left is the calls' own spread)
        for p in PATHS:
            pairs = zip(samples[("tickets", p)], samples[("off", p)], strict=True)
            out[f"{tag}b{batch}/{p}/paired_ratio"] = statistics.median(a / b for a, b in pairs)
        print(
            f"attend {tag}batch {batch}: "
            + ", ".join(f"{k}={statistics.median(s) * 1e3:.3f}ms" for k, s in samples.items()),
            flush=True,
        )
    return out


def _transfers(
    parent: Any, ports: dict[str, int], certs: str, repeats: int, nbytes: int = TRANSFER_BYTES
) -> dict[str, Any]:
    n = nbytes // (2 * SPEC["num_layers"] * SPEC["num_kv_heads"] * SPEC["head_dim"] * 4)
    shape = (SPEC["num_layers"], n, SPEC["num_kv_heads"], SPEC["head_dim"])
    k, v = torch.randn(shape), torch.randn(shape)
    out_k, out_v = torch.empty(shape), torch.empty(shape)
    tokens = list(range(n))
    combos = [(var, p) for var in VARIANTS for p in TLS_PATHS]
    rates: dict[str, list[float]] = {}
    for rep in range(repeats):
        for var, p in combos:
            parent.send("reset")
            parent.recv()
            c = _client(var, ports[var], PATHS[p], certs, ["x"])
            try:
                seq = c.node(f"127.0.0.1:{ports[var]}").data
                start = time.perf_counter()
                seq.append("x", tokens, k, v)
                up = time.perf_counter() - start
                start = time.perf_counter()
                seq.read_kv("x", 0, n, out=(out_k, out_v))
                down = time.perf_counter() - start
            finally:
                c.close()
            if rep == 0:
                assert torch.equal(out_k, k) and torch.equal(out_v, v), (var, p)
            rates.setdefault(f"upload/{p}/{var}", []).append(nbytes / up / 1e9)
            rates.setdefault(f"download/{p}/{var}", []).append(nbytes / down / 1e9)
            gb_up, gb_down = nbytes / up / 1e9, nbytes / down / 1e9
            print(f"transfer {p}/{var} #{rep}: up {gb_up:.2f} GB/s, down {gb_down:.2f} GB/s", flush=True)
    return {key: {"gbps": statistics.median(r), "all": r} for key, r in rates.items()}


def _check_cost() -> dict[str, Any]:
    """Microseconds per call of the node's gate (gRPC: the call's metadata parsed and
    checked; bulk: the connection's credentials checked) and of the client's wallet."""
    from pagedkv.cache_node.gate import Gate, NodeTrust
    from pagedkv.client.transport.tickets import Wallet
    from pagedkv.protos.tickets import RIGHT_DATA, RIGHT_READ, ClusterKeys, Ticket, issue

    keys = ClusterKeys([SECRET])
    gate = Gate(NodeTrust(keys, "", NODE_ID))
    gate.set_registration(NODE_ID, EPOCH)
    out: dict[str, Any] = {}
    for batch in BATCHES:
        ids = [f"s{i}" for i in range(batch)]
        wallet = Wallet()
        expires = int(time.time()) + 3600
        for s in ids:
            wallet.add(s, s, issue(keys, Ticket(RIGHT_DATA, expires, EPOCH, TENANT, s, NODE_ID)))
        meta = wallet.metadata(ids)
        creds = gate.from_metadata(meta)
        n = 20_000 // batch

        def per_call_us(fn: Any, n: int = n) -> float:
            best = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                best.append((time.perf_counter() - start) / n * 1e6)
            return min(best)

        def grpc_check(meta: Any = meta, ids: list[str] = ids) -> None:
            gate.require(gate.from_metadata(meta), ids, RIGHT_READ, "Attend")

        out[f"b{batch}"] = {
            "node_grpc_us": per_call_us(grpc_check),
            "node_bulk_us": per_call_us(
                lambda creds=creds, ids=ids: gate.require(creds, ids, RIGHT_READ, "Attend")
            ),
            "client_us": per_call_us(lambda w=wallet, ids=ids: (w.node_ids(ids), w.metadata(ids))),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.security", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer calls, one transfer repeat")
    p.add_argument("--repeats", type=int, default=3, help="256 MiB transfers per path and variant")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    p.add_argument("--smoke", action="store_true", help="2 calls per row, 4 MiB transfers (CI)")
    args = p.parse_args(argv)
    divisor = 1000 if args.smoke else 5 if args.quick else 1
    repeats = 1 if args.quick or args.smoke else args.repeats
    # A smoke run proves the code runs: short sequences and small transfers set the node up fast.
    context_len, transfer_bytes = (SMOKE_LEN, 4 << 20) if args.smoke else (CONTEXT_LEN, TRANSFER_BYTES)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        certs = _certs(tmp)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_node, args=(child, certs, context_len, transfer_bytes), daemon=True)
        proc.start()
        try:
            ports = parent.recv()
            results = {
                "attend": _attends(ports, certs, divisor),
                "transfer": _transfers(parent, ports, certs, repeats, transfer_bytes),
                "check": _check_cost(),
            }
        finally:
            parent.send("stop")
            proc.join(30)
    results["meta"] = {
        "load_before": load,
        "load_after": os.getloadavg(),
        "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(),
        "context_len": context_len,
        "quick": args.quick,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "security.json").write_text(json.dumps(results, indent=1))
    text = render(results)
    (args.out / "security.md").write_text(text)
    print(text)


def render(r: dict[str, Any]) -> str:
    a, t, meta = r["attend"], r["transfer"], r["meta"]
    lines = [
        "# Security on the data path (bench.security)",
        "",
        f"Load {meta['load_before'][0]:.1f} before, {meta['load_after'][0]:.1f} after; "
        f"{meta['nproc']} CPUs; L = {meta['context_len']}.",
        "",
        "| attend p50 (ms) | path | off | tickets | tickets+tls | tickets / off | tickets / off, paired | "
        "tls / tickets |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch in BATCHES:
        for path in PATHS:
            off, on = a[f"b{batch}/{path}/off"]["p50_ms"], a[f"b{batch}/{path}/tickets"]["p50_ms"]
            tls = a.get(f"b{batch}/{path}/tickets+tls", {}).get("p50_ms")
            tls_cell, ratio = ("-", "-") if tls is None else (f"{tls:.3f}", f"{tls / on:.2f}x")
            paired = a[f"b{batch}/{path}/paired_ratio"]
            lines.append(
                f"| batch {batch} | {path} | {off:.3f} | {on:.3f} | {tls_cell} | {on / off:.3f}x | "
                f"{paired:.3f}x | {ratio} |"
            )
    lines += [
        "",
        f"| attend p50 (ms), L = {SHORT_LEN}: the transport's floor | path | off | tickets | "
        "tickets / off, paired |",
        "|---|---|---|---|---|",
    ]
    for batch in BATCHES:
        for path in PATHS:
            off, on = (a[f"short/b{batch}/{path}/{v}"]["p50_ms"] for v in ("off", "tickets"))
            paired = a[f"short/b{batch}/{path}/paired_ratio"]
            lines.append(f"| batch {batch} | {path} | {off:.3f} | {on:.3f} | {paired:.3f}x |")
    lines += [
        "",
        "| 256 MiB (GB/s) | path | off | tickets | tickets+tls | tls / tickets |",
        "|---|---|---|---|---|---|",
    ]
    for direction in ("upload", "download"):
        for path in TLS_PATHS:
            vals = [t[f"{direction}/{path}/{v}"]["gbps"] for v in VARIANTS]
            cells = " | ".join(f"{x:.2f}" for x in vals)
            lines.append(f"| {direction} | {path} | {cells} | {vals[2] / vals[1]:.2f}x |")
    auth = {k.split("/", 1)[1]: v for k, v in a.items() if k.startswith("auth_round_trips/")}
    lines += [
        "",
        f"AUTH round trips per client over the whole run (tickets presented once per connection): {auth}",
        "",
        "| ticket check, in process (us per call) | node, gRPC (metadata parsed) | node, bulk | client | "
        "share of the tickets path's fastest attend p50 (node + client) |",
        "|---|---|---|---|---|",
    ]
    for batch in BATCHES:
        c = r["check"][f"b{batch}"]
        fastest = min(a[f"b{batch}/{p}/tickets"]["p50_ms"] for p in PATHS) * 1e3
        worst = (max(c["node_grpc_us"], c["node_bulk_us"]) + c["client_us"]) / fastest
        lines.append(
            f"| batch {batch} | {c['node_grpc_us']:.2f} | {c['node_bulk_us']:.2f} | {c['client_us']:.2f} | "
            f"{worst:.2%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
