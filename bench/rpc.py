"""RPC overhead and KV transfer throughput of the cache node, side by side, in one run.

    python -m bench.rpc            # ~1-2 min on CPU; writes bench/results/rpc.{json,md}

The node runs in a child process (as in production: the client and the server do
not share a GIL). Measured in the same run:

- attend latency p50/p99 for decode batches of 1 and 32 sequences of L tokens,
  one layer, through the client's `attend_batch` over each data path: the
  Attend rpc (gRPC) and the node's bulk TCP channel (ATTEND op, docs/bulk-protocol.md;
  what the client uses whenever the node advertises the channel);
- the same engine call in the server process, without a transport (`engine.attend_decode`);
- a no-op Ping RPC on the same server and channel, and the bulk channel's own
  PING op on each of its sockets: the latency floor of each path;
- the channel's two paths alternating call by call: TCP (what a client on another
  host gets) and the same-host shared-memory path (ATTEND_SHM: the tensors through
  a memfd region, a 32-byte header over a Unix socket; what a client on the node's
  host gets), each with `call - handler` per call (the client's wall minus the
  node's own handler time for that call: the transport without the engine's
  run-to-run spread) and the request refused by validation (no engine).

Overhead is defined as `call_p50 - engine_p50` (encode, transport, decode, server
dispatch) and compared with both floors: the goal is overhead <= 1.3 x ping_p50
(the gRPC Ping); the ratio to the channel's PING says how close it is to its own floor.

A batch-32 call waits ~32 ms for its engine, and on a VM a process that waited that
long runs its next few hundred microseconds slower (cold caches, an idle vCPU to
wake). So the run also times the gRPC Ping with both processes idle that long before
each call (the floor in the batch-32 call's conditions), and a control: batch 32's
request and reply sizes over sequences of SHORT_LEN tokens (an engine ~60x shorter),
back to back and with the same idle first.

KV upload and download of a 256 MiB range are timed end to end through the
client API (tensors in, tensors out, checked byte-exact) over each path -- the
gRPC rpcs (Append client-streaming, ReadKV server-streaming), the bulk channel's
TCP socket, its same-host Unix socket and its same-host shared-memory read
(READ_SHM: slabs through a 2 x 2 MiB ring in the client's memfd region; its
append takes the Unix socket) (docs/bulk-protocol.md), each repeat running every path in
turn -- and compared with a plain loopback TCP socket moving the same bytes in the
same loop. Downloads are timed into fresh tensors and into the caller's (`out=`,
allocated once): a fresh 256 MiB's first touch is part of the former.
`--transfer-only` runs just this part (`--quick`: without the gRPC rows).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch  # after bench/__init__.py, which sets pagedkv's process environment (THP, OpenMP spin)

SPEC = {"num_layers": 1, "num_kv_heads": 8, "head_dim": 128, "dtype": "float32", "block_size": 16}
NUM_Q_HEADS = 32
CONTEXT_LEN = 2048
SMOKE_LEN = 128  # --smoke's sequences: the same code paths, a node set up in a second
BATCHES = (1, 32)
SHORT_LEN = 64  # the control rows: batch 32's request and reply sizes, an engine ~60x shorter
IDLE_S = 0.032  # ~the batch-32 engine at L = 2048: the control with the client idle that long first
TRANSFER_BYTES = 256 << 20
RESULTS = Path(__file__).resolve().parent / "results"


def _pcts(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50_ms": statistics.median(ms), "p99_ms": p99, "n": len(ms)}


SMOKE_ITERS = 0  # --smoke: this many calls per measurement (tests/bench: the code runs, no figure)


def _iters(batch: int, quick: bool) -> int:
    if SMOKE_ITERS:
        return SMOKE_ITERS
    n = 300 if batch == 1 else 40
    return max(10, n // 5) if quick else n


def _node_process(conn: Any, quick: bool, context_len: int, with_transfers: bool) -> None:
    """Child: build the engine, fill the batch sequences, time the in-process
    engine call, then serve until the parent says stop."""
    from pagedkv.cache_node.engine import CacheEngine, EngineConfig
    from pagedkv.cache_node.server import create_server
    from pagedkv.protos.spec import ModelSpec

    spec = ModelSpec(**SPEC)
    per_seq = context_len // spec.block_size
    transfer_blocks = TRANSFER_BYTES // spec.bytes_per_block + 1 if with_transfers else 0
    short_blocks = max(BATCHES) * (SHORT_LEN // spec.block_size)
    num_blocks = max(BATCHES) * per_seq + short_blocks + transfer_blocks + 16
    engine = CacheEngine(EngineConfig(spec, num_blocks, device="cpu"))
    g = torch.Generator().manual_seed(0)
    for prefix, length in (("s", context_len), ("short", SHORT_LEN)):
        shape = (1, length, spec.num_kv_heads, spec.head_dim)
        for i in range(max(BATCHES)):
            first = i * 10**6 + (0 if prefix == "s" else 500_000)
            toks = list(range(first, first + length))  # distinct: no prefix sharing
            engine.open(f"{prefix}{i}", toks)
            kv = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            engine.append(f"{prefix}{i}", toks, *kv)
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    floor, floor_port = _floor_server(engine, spec.head_dim)
    conn.send((port, floor_port))
    # Time the engine on request, between the RPC runs, so both see the same warm
    # state. The call runs on a worker thread like a gRPC handler does (OpenMP
    # keeps per-calling-thread teams, so the main thread would not be comparable).
    pool = ThreadPoolExecutor(1)
    while (cmd := conn.recv()) != "stop":
        if cmd == "attend_handler":  # (sum s, count) of the node's Attend latency metric so far
            hist = server.metrics.rpc_latency.labels("Attend")
            conn.send((hist._sum.get(), sum(b.get() for b in hist._buckets)))
            continue
        b, iters, gap_s = cmd
        q = torch.randn(b, NUM_Q_HEADS, spec.head_dim)
        ids = [f"s{i}" for i in range(b)]

        def run(
            ids: list[str] = ids, q: torch.Tensor = q, iters: int = iters, gap_s: float = 0.0
        ) -> list[float]:
            for _ in range(3):
                engine.attend_decode(ids, 0, q)
            samples = []
            for _ in range(iters):
                if gap_s:
                    time.sleep(gap_s)  # idle between calls, as between RPCs
                t0 = time.perf_counter()
                engine.attend_decode(ids, 0, q)
                samples.append(time.perf_counter() - t0)
            return samples

        if gap_s:
            conn.send(_pcts(pool.submit(run, ids, q, iters, gap_s).result()))
        else:
            conn.send(_pcts(pool.submit(run).result()))
    server.stop(1)
    floor.stop(0)


def _floor_server(engine: Any, head_dim: int) -> tuple[Any, int]:
    """A bare gRPC-Python server (no pagedkv servicer, no protobuf) with two methods
    that reply with the seconds their handler took and a payload the size of an
    attend reply. Wait blocks (GIL released) for the seconds it is asked: the floor
    any gRPC-Python handler of that duration pays on this host. Engine runs the
    in-process engine call of a batch of the size it is asked: how long that call
    takes when it is driven by RPCs rather than timed back to back."""
    import grpc

    queries = {b: torch.randn(b, NUM_Q_HEADS, head_dim) for b in BATCHES}

    def wait(request: bytes, context: Any) -> bytes:
        seconds = float(request[:32].decode())
        t0 = time.perf_counter()
        time.sleep(seconds)
        return f"{time.perf_counter() - t0:<32.9f}".encode() + bytes(len(request) - 32)

    def run_engine(request: bytes, context: Any) -> bytes:
        b = int(float(request[:32].decode()))
        t0 = time.perf_counter()
        engine.attend_decode([f"s{i}" for i in range(b)], 0, queries[b])
        return f"{time.perf_counter() - t0:<32.9f}".encode() + bytes(len(request) - 32)

    handler = grpc.method_handlers_generic_handler(
        "bench.Floor",
        {
            "Wait": grpc.unary_unary_rpc_method_handler(wait),
            "Engine": grpc.unary_unary_rpc_method_handler(run_engine),
        },
    )
    server = grpc.server(ThreadPoolExecutor(16))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _floor_overhead(port: int, method: str, arg: float, payload: int, iters: int) -> dict[str, float]:
    """p50 of (rpc time - time the handler took) on the bare server, per call, and
    the handler's p50 (blocked_p50_ms)."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        wait = ch.unary_unary(f"/bench.Floor/{method}")
        request = f"{arg:<32.9f}".encode() + bytes(payload)
        samples, blocked = [], []
        for i in range(iters + 10):
            t0 = time.perf_counter()
            reply = wait(request, timeout=10)
            rpc = time.perf_counter() - t0
            if i >= 10:
                blocked.append(float(reply[:32].decode()))
                samples.append(rpc - blocked[-1])
    return {
        "overhead_p50_ms": statistics.median(samples) * 1e3,
        "blocked_p50_ms": statistics.median(blocked) * 1e3,
    }


def _loopback_socket_gbps(data: memoryview, chunk: int) -> float:
    """Seconds to move `data` over a loopback TCP socket (sendall / recv_into), as GB/s."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    sink = bytearray(len(data))

    def receive() -> None:
        conn, _ = srv.accept()
        with conn:
            view, got = memoryview(sink), 0
            while got < len(sink):
                got += conn.recv_into(view[got:], min(chunk, len(sink) - got))

    t = threading.Thread(target=receive)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for off in range(0, len(data), chunk):
            c.sendall(data[off : off + chunk])
        t.join()
        elapsed = time.perf_counter() - t0
    srv.close()
    return len(data) / elapsed / 1e9


def _transfers(address: str, results: dict[str, Any], repeats: int, quick: bool = False) -> None:
    """Upload and download TRANSFER_BYTES over each path, next to a loopback socket."""
    from pagedkv.client import CacheClient, ClientConfig

    n_tokens = TRANSFER_BYTES // (2 * 8 * 128 * 4)
    shape = (1, n_tokens, 8, 128)
    k, v = torch.randn(shape), torch.randn(shape)
    toks = list(range(7 * 10**8, 7 * 10**8 + n_tokens))
    raw = memoryview(torch.cat([k.flatten(), v.flatten()]).numpy()).cast("B")
    # name -> (client config, same-host path allowed, READ_SHM allowed); gRPC is the contract for small calls
    paths = {
        "gRPC, 1 MiB chunks": (ClientConfig(chunk_bytes=1 << 20, bulk_min_bytes=None), False, False),
        "gRPC, 4 MiB chunks": (ClientConfig(chunk_bytes=4 << 20, bulk_min_bytes=None), False, False),
        "bulk channel, TCP": (ClientConfig(transports=("tcp", "grpc")), False, False),
        "bulk channel, same-host Unix socket": (
            ClientConfig(transports=("unix", "tcp", "grpc")),
            True,
            False,
        ),
        "bulk channel, same-host shared memory (READ_SHM; append: Unix socket)": (ClientConfig(), True, True),
    }
    if quick:  # the gRPC rows take most of the time
        paths = {name: p for name, p in paths.items() if not name.startswith("gRPC")}
    runs: dict[str, dict[str, list[float]]] = {
        name: {"up": [], "down": [], "down_into": [], "sock": []} for name in paths
    }
    # read_kv(out=...): the caller's buffers, touched once here (a fresh 256 MiB allocation's first
    # touch alone takes 20 ms, or ~320 ms on pages this VM's host reclaimed: free page reporting)
    into = (torch.ones_like(k), torch.ones_like(v))
    clients = {name: CacheClient(address, cfg) for name, (cfg, _, _) in paths.items()}
    try:
        for r in range(repeats):  # interleaved: each repeat runs every path once, in turn
            for name, (cfg, _, _) in paths.items():
                c, run = clients[name], runs[name]
                seq = c.open(f"up{len(results['transfer'])}-{name}-{r}", toks[:1])  # distinct ids
                t0 = time.perf_counter()
                seq.append(toks, k, v)
                run["up"].append(TRANSFER_BYTES / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                rk, rv = seq.read_kv()
                run["down"].append(TRANSFER_BYTES / (time.perf_counter() - t0) / 1e9)
                if not (torch.equal(rk, k) and torch.equal(rv, v)):
                    raise AssertionError(f"{name}: read_kv returned other bytes than appended")
                del rk, rv
                t0 = time.perf_counter()
                rk, rv = seq.read_kv(out=into)
                run["down_into"].append(TRANSFER_BYTES / (time.perf_counter() - t0) / 1e9)
                if rk is not into[0] or not (torch.equal(rk, k) and torch.equal(rv, v)):
                    raise AssertionError(f"{name}: read_kv(out=) returned other bytes than appended")
                del rk, rv
                for t in into:
                    t.fill_(0.0)  # so that the next path's read is checked, not this one's bytes
                seq.close()
                run["sock"].append(_loopback_socket_gbps(raw, cfg.chunk_bytes))
        for name, (cfg, local, read_shm) in paths.items():
            bulk = clients[name].data.bulk
            used_bulk = bulk is not None and bool(bulk.port)
            if used_bulk != (cfg.bulk_min_bytes is not None):
                raise AssertionError(f"{name}: bulk channel used = {used_bulk}")
            if bulk is not None and bulk.num_local_transfers != (3 * repeats if local else 0):
                raise AssertionError(f"{name}: {bulk.num_local_transfers} transfers over the Unix socket")
            if bulk is not None and bulk.num_shm_reads != (2 * repeats if read_shm else 0):
                raise AssertionError(f"{name}: {bulk.num_shm_reads} reads through the shared region")
            run = runs[name]
            row = {
                "upload_gbps": statistics.median(run["up"]),
                "download_gbps": statistics.median(run["down"]),
                "download_into_gbps": statistics.median(run["down_into"]),
                "loopback_socket_gbps": statistics.median(run["sock"]),
                "upload_runs_gbps": run["up"],
                "download_runs_gbps": run["down"],
                "download_into_runs_gbps": run["down_into"],
                "bytes": TRANSFER_BYTES,
                "repeats": repeats,
            }
            results["transfer"][name] = row
            print(f"transfer, {name}: {row}", flush=True)
    finally:
        for c in clients.values():
            c.close()


def _handler_sum_s(parent: Any) -> float:
    """Seconds the node's Attend handlers took so far (the latency metric's sum)."""
    parent.send("attend_handler")
    return float(parent.recv()[0])


def _paths_interleaved(
    clients: dict[str, Any], parent: Any, ids: list[str], q: Any, iters: int, idle_s: float = 0.0
) -> dict[str, Any]:
    """Attend over the channel's TCP socket and its same-host shared-memory path,
    alternating call by call. Per call also `call - handler`: the client's wall minus
    the node's own handler time for that very call (parse + engine), which leaves the
    transport alone and does not move with the engine's run-to-run spread. Then the
    same request refused by the node's validation over each (the path without the engine).
    idle_s: both processes idle that long before each timed call (untimed)."""
    from pagedkv.client import PagedKVError

    samples: dict[str, list[float]] = {"tcp": [], "shm": []}
    net: dict[str, list[float]] = {"tcp": [], "shm": []}
    channel = clients["shm"].data.bulk
    local_before = channel.num_local_calls
    for path in ("tcp", "shm"):  # warm both connections (the region is mapped on the first call)
        for _ in range(3):
            clients[path].attend_batch(ids, 0, q)
    before = _handler_sum_s(parent)
    for i in range(2 * iters):
        path = ("tcp", "shm")[i % 2]
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        clients[path].attend_batch(ids, 0, q)
        wall = time.perf_counter() - t0
        after = _handler_sum_s(parent)
        samples[path].append(wall)
        net[path].append(wall - (after - before))
        before = after
    if channel.num_local_calls - local_before != 3 + iters:
        raise AssertionError("a same-host attend fell back to TCP")
    refused: dict[str, list[float]] = {"tcp": [], "shm": []}
    for i in range(2 * iters):  # the same request refused by validation (layer out of range): no engine
        path = ("tcp", "shm")[i % 2]
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        try:
            clients[path].data.attend(ids, SPEC["num_layers"], q)
        except PagedKVError:
            refused[path].append(time.perf_counter() - t0)
    return {
        p: {"call": _pcts(samples[p]), "call_minus_handler": _pcts(net[p]), "refused_call": _pcts(refused[p])}
        for p in samples
    }


def main(argv: list[str] | None = None) -> None:
    from bench.rpc_report import plot, render, render_transfer  # it reads this module's constants

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="transfers per direction (median reported)")
    parser.add_argument("--no-transfer", action="store_true", help="latency only (no KV transfers)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument(
        "--transfer-only",
        action="store_true",
        help="KV transfers only (no latency part): prints the table, writes no results;\n"
        "with --quick, without the gRPC rows",
    )
    parser.add_argument("--smoke", action="store_true", help="2 calls per row, no transfers (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        global SMOKE_ITERS
        SMOKE_ITERS, args.quick, args.no_transfer = 2, True, True
    from pagedkv.client import CacheClient, ClientConfig, InvalidArgument

    grpc_only = ClientConfig(bulk_min_bytes=None)  # every data call over the rpcs
    t_start = time.perf_counter()
    # A smoke run only proves the code runs: short sequences and no transfer room keep the
    # node's set-up (half a GiB of random K/V at full size) out of CI's time.
    context_len = SMOKE_LEN if args.smoke else CONTEXT_LEN
    print(f"starting node (spec {SPEC}, {max(BATCHES)} x {context_len} tokens) ...", flush=True)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    node_args = (child, args.quick, context_len, not args.no_transfer)
    proc = ctx.Process(target=_node_process, args=node_args, daemon=True)
    proc.start()
    port, floor_port = parent.recv()
    address = f"127.0.0.1:{port}"
    print(f"node on {address}", flush=True)
    results: dict[str, Any] = {
        "spec": SPEC,
        "num_q_heads": NUM_Q_HEADS,
        "context_len": context_len,
        "host": {"cpus": mp.cpu_count(), "machine": platform.machine(), "torch": torch.__version__},
        "latency": {},
        "transfer": {},
    }
    if args.transfer_only:
        try:
            _transfers(address, results, args.repeats, args.quick)
        finally:
            parent.send("stop")
            proc.join(10)
        results["runtime_s"] = time.perf_counter() - t_start
        print("\n".join(render_transfer(results)))
        return
    try:
        tcp_only = ClientConfig(transports=("tcp", "grpc"))  # the channel rows below are its TCP socket
        with (
            CacheClient(address, grpc_only) as client,
            CacheClient(address, tcp_only) as via_bulk,
            CacheClient(address) as via_shm,
        ):
            channel = via_bulk.data.bulk_channel(5.0)
            if channel is None or via_shm.data.bulk_channel(5.0) is None:
                raise AssertionError("the node advertises no bulk channel")
            tcp, unix = via_bulk.data.transports.get("tcp"), via_shm.data.transports.get("unix")
            both = {"tcp": via_bulk, "shm": via_shm}
            for _ in range(20):
                client.ping()
                tcp.ping(5.0)
            samples = []
            for _ in range(_iters(1, args.quick) * 2):
                t0 = time.perf_counter()
                tcp.ping(5.0)
                samples.append(time.perf_counter() - t0)
            bulk_ping = _pcts(samples)
            results["latency"]["bulk_ping"] = bulk_ping
            for _ in range(20):
                unix.ping(5.0)
            samples = []
            for _ in range(_iters(1, args.quick) * 2):
                t0 = time.perf_counter()
                unix.ping(5.0)
                samples.append(time.perf_counter() - t0)
            results["latency"]["shm_ping"] = _pcts(samples)
            print(f"same-host PING: {results['latency']['shm_ping']}", flush=True)
            print(f"bulk channel PING: {bulk_ping}", flush=True)
            for _ in range(20):
                client.ping()
            samples = []
            for _ in range(_iters(1, args.quick) * 2):
                t0 = time.perf_counter()
                client.ping()
                samples.append(time.perf_counter() - t0)
            ping = _pcts(samples)
            results["latency"]["ping"] = ping
            print(f"ping: {ping}", flush=True)
            samples = []  # the floor in the batch-32 call's conditions: the processes idle that long first
            for _ in range(2 * _iters(max(BATCHES), args.quick)):
                time.sleep(IDLE_S)
                t0 = time.perf_counter()
                client.ping()
                samples.append(time.perf_counter() - t0)
            results["latency"]["ping_idle"] = _pcts(samples)
            print(f"ping, idle {IDLE_S * 1e3:.0f} ms first: {results['latency']['ping_idle']}", flush=True)
            for b in BATCHES:
                q = torch.randn(b, NUM_Q_HEADS, SPEC["head_dim"])
                ids = [f"s{i}" for i in range(b)]
                for _ in range(3):
                    client.attend_batch(ids, 0, q)
                samples = []
                for _ in range(_iters(b, args.quick)):
                    t0 = time.perf_counter()
                    client.attend_batch(ids, 0, q)
                    samples.append(time.perf_counter() - t0)
                rpc = _pcts(samples)
                calls_before = channel.num_calls
                for _ in range(3):
                    via_bulk.attend_batch(ids, 0, q)
                parent.send("attend_handler")
                handler_before = parent.recv()
                samples = []
                for _ in range(_iters(b, args.quick)):
                    t0 = time.perf_counter()
                    res = via_bulk.attend_batch(ids, 0, q)
                    samples.append(time.perf_counter() - t0)
                if not torch.equal(res.out, client.attend_batch(ids, 0, q).out):
                    raise AssertionError("bulk channel and rpc disagree")
                over_bulk = _pcts(samples)
                parent.send("attend_handler")
                handler_sum, handler_count = (
                    a - b for a, b in zip(parent.recv(), handler_before, strict=True)
                )
                # node side of a channel call: from its body received to its reply handed to the socket
                handler_mean_ms = handler_sum / handler_count * 1e3
                call_mean_ms = statistics.fmean(samples) * 1e3
                if channel.num_calls - calls_before != 3 + len(samples):
                    raise AssertionError("an attend over the bulk channel fell back to gRPC")
                samples = []  # the request refused by the node's validation: the channel without the engine
                for _ in range(_iters(b, args.quick)):
                    t0 = time.perf_counter()
                    try:
                        via_bulk.data.attend(ids, SPEC["num_layers"], q)  # layer out of range
                    except InvalidArgument:
                        samples.append(time.perf_counter() - t0)
                refused = _pcts(samples)
                parent.send((b, _iters(b, args.quick), 0.0))
                eng = parent.recv()
                overhead = rpc["p50_ms"] - eng["p50_ms"]
                # the same engine call paced like the RPC loop: idle for the non-engine part of an RPC
                parent.send((b, _iters(b, args.quick), max(0.0, overhead) / 1e3))
                paced = parent.recv()
                n = _iters(b, args.quick)
                floor = _floor_overhead(floor_port, "Wait", eng["p50_ms"] / 1e3, q.numel() * 4, n)
                in_rpc = _floor_overhead(floor_port, "Engine", b, q.numel() * 4, n)
                bulk_overhead = over_bulk["p50_ms"] - eng["p50_ms"]
                paths = _paths_interleaved(both, parent, ids, q, 2 * _iters(b, args.quick))
                for p in paths.values():
                    p["overhead_p50_ms"] = p["call"]["p50_ms"] - eng["p50_ms"]
                    p["overhead_over_ping_p50"] = p["overhead_p50_ms"] / ping["p50_ms"]
                    p["call_minus_handler_over_ping_p50"] = p["call_minus_handler"]["p50_ms"] / ping["p50_ms"]
                results["latency"][f"attend_paths_b{b}"] = paths
                print(f"attend batch {b}, TCP vs same-host: {paths}", flush=True)
                parent.send((b, _iters(b, args.quick), max(0.0, bulk_overhead) / 1e3))
                bulk_paced = parent.recv()
                results["latency"][f"attend_bulk_b{b}"] = {
                    "call": over_bulk,
                    "engine": eng,
                    "engine_paced": bulk_paced,
                    "refused_call": refused,
                    "call_mean_ms": call_mean_ms,
                    "node_handler_mean_ms": handler_mean_ms,
                    "overhead_p50_ms": bulk_overhead,
                    "overhead_over_ping_p50": bulk_overhead / ping["p50_ms"],
                    "overhead_over_bulk_ping_p50": bulk_overhead / bulk_ping["p50_ms"],
                }
                print(
                    f"attend batch {b} over the bulk channel: {over_bulk}, overhead {bulk_overhead:.3f} ms",
                    flush=True,
                )
                results["latency"][f"attend_b{b}"] = {
                    "rpc": rpc,
                    "engine": eng,
                    "overhead_p50_ms": overhead,
                    "overhead_over_ping_p50": overhead / ping["p50_ms"],
                    "q_bytes": q.numel() * 4,
                    "bare_grpc_floor": {**floor, "over_ping_p50": floor["overhead_p50_ms"] / ping["p50_ms"]},
                    "engine_paced": paced,
                    "engine_in_bare_grpc_handler": in_rpc,
                }
                print(
                    f"attend batch {b}: rpc {rpc} engine {eng} overhead {overhead:.3f} ms, "
                    f"bare gRPC floor {floor}, engine in a bare handler {in_rpc}",
                    flush=True,
                )

            # The control: batch 32's request and reply sizes over an engine ~60x shorter, back to
            # back, then with both processes idle for a batch-32 engine's time before each call.
            b = max(BATCHES)
            q = torch.randn(b, NUM_Q_HEADS, SPEC["head_dim"])
            short_ids = [f"short{i}" for i in range(b)]
            n = 2 * _iters(b, args.quick)
            for name, idle_s in (("warm", 0.0), ("idle", IDLE_S)):
                paths = _paths_interleaved(both, parent, short_ids, q, n, idle_s)
                for p in paths.values():
                    p["call_minus_handler_over_ping_p50"] = p["call_minus_handler"]["p50_ms"] / ping["p50_ms"]
                results["latency"][f"attend_short_{name}"] = {**paths, "idle_s": idle_s}
                print(f"attend batch {b} at L = {SHORT_LEN}, {name}: {paths}", flush=True)

            if not args.no_transfer:
                _transfers(address, results, args.repeats, args.quick)
    finally:
        parent.send("stop")
        proc.join(10)
    results["runtime_s"] = time.perf_counter() - t_start
    if args.no_transfer and not args.smoke:
        print(render(results))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rpc.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "rpc.md").write_text(render(results))
    plot(results, args.out / "rpc.png")
    print(render(results))


if __name__ == "__main__":
    main()
