"""Time to first token with a cached prefix vs full recompute, and decode speed, through a node.

    python -m bench.ttft [--repeats 7] [--prefix 1024] [--suffix 128] [--decode 32] [--no-large]

Random Llamas on the CPU (fp32, no download): the issue's small one (4 layers, hidden 256, GQA 4/2)
and, side by side, a larger one (8 layers, hidden 512, GQA 8/2) where the model's own compute is a
bigger share. Each is served by two nodes, both real node servers on localhost (control calls over
gRPC; the per-layer data calls over the node's bulk TCP channel, as the client does whenever a node
advertises it):

- `process`: the node in its own process (`pagedkv node`), as a deployment runs it (one process
  per device); worker and node share this VM's cores but not a GIL;
- `in-process`: the node's server in the worker's process (the earlier setup: handler threads
  share the worker's GIL).

and, for comparison in the same run, the cached path to the node process with every data call on
the gRPC rpcs (`process, gRPC only`: ClientConfig(bulk_min_bytes=None)), and with the prefix's K/V
read back to the worker (`process, gathered KV`: PagedKVCache(mode="gather"), attention local).

Measured in one run, variants interleaved per repeat, medians:

- cached:          open the prompt (the prefix already cached), run the model on the suffix with
                   attention on the node, pick the first token;
- local recompute: transformers with its own DynamicCache computes every position;
- local floor:     the suffix's forward on a DynamicCache that already holds the prefix (the
                   cached path's compute with no node and no transport: what it cannot beat);
- node recompute:  the same prompt with nothing cached, attention on the node;
- decode tokens/s: one token per step after the prompt (batch 1 and 8), node vs DynamicCache;
- a phase profile of the cached path (in-process node, separate untimed pass), once over the bulk
  channel and once over gRPC only: Open, the AttendPrefillBatch calls (and the node's engine time
  inside them) and the worker's model compute.

Writes bench/results/ttft.json and bench/results/ttft.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server
from pagedkv.client import ClientConfig
from pagedkv.client.transformers import (
    GrpcBackend,
    PagedKVCache,
    demo_model,
    node_spec,
    prefill_with_prefix_cache,
)

RESULTS = Path(__file__).with_name("results")
MODELS = {
    "small": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 1000},
    "large": {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 1000},
}
TRANSPORTS = ("process", "in-process")
GRPC_ONLY = ClientConfig(bulk_min_bytes=None)  # every data call on the rpcs
GATHER = "process, gathered KV"  # PagedKVCache(mode="gather"): the prefix's K/V read back, local attention
ONE_THREAD = "process, compute thread on"  # pagedkv node --compute-thread on: engine calls on one thread
SIDE_VARIANTS = {"process, gRPC only": 600, GATHER: 700, ONE_THREAD: 800}  # suffix seeds of their own
CALLS = "AttendPrefillBatch calls (client wall)"
ENGINE = "node engine.attend_prefill (append + attention)"
TRANSPORT = "transport, encode/decode, backend tensor prep (calls - engine)"
NUM_BLOCKS = 4096
# Both TTFT paths compute the logits of the last position only (logits_to_keep=1).


def tokens(seed: int, n: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 1000, (rows, n), generator=torch.Generator().manual_seed(seed))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def decode_steps(model: Any, cache: Any, first: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy decode steps (one token per row each)."""
    nxt = first
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(input_ids=nxt, cache=cache, use_cache=True).logits
        nxt = logits[:, -1:].argmax(-1)
    return time.perf_counter() - start


def node_recompute(model: Any, backend: GrpcBackend, prompt: torch.Tensor) -> float:
    """Seconds for a prompt with nothing cached, every position's attention on the node."""
    with PagedKVCache(model, backend) as cache:
        dt, _ = timed(lambda: prefill_with_prefix_cache(model, cache, prompt, logits_to_keep=1))
    return dt


def local_floor(model: Any, cache: DynamicCache, suffix: torch.Tensor) -> float:
    """Seconds for the suffix's forward on a DynamicCache already holding the prefix (the cached
    path's floor: the same compute with no node, no transport); the suffix is cropped off after."""
    dt, _ = timed(lambda: model(suffix, cache=cache, logits_to_keep=1))
    cache.crop(-suffix.shape[1])
    return dt


@contextmanager
def node_process(spec: Any, compute_thread: bool = False) -> Iterator[str]:
    """`pagedkv node` in a child process serving `spec`; yields its address."""
    cmd = [
        sys.executable,
        "-m",
        "pagedkv",
        "node",
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "-1",
        "--num-layers",
        str(spec.num_layers),
        "--num-kv-heads",
        str(spec.num_kv_heads),
        "--head-dim",
        str(spec.head_dim),
        "--dtype",
        spec.dtype,
        "--block-size",
        str(spec.block_size),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--device",
        "cpu",
        "--grace-s",
        "0.1",
        "--compute-thread",
        "on" if compute_thread else "off",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"listening on (\S+):(\d+)", line)
        if found is None:
            raise RuntimeError(f"pagedkv node did not start: {line!r}")
        yield f"127.0.0.1:{found.group(2)}"
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def node_in_process(spec: Any) -> Iterator[str]:
    engine = CacheEngine(EngineConfig(spec, NUM_BLOCKS, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


class PerRowBackend(GrpcBackend):
    """One AttendPrefill rpc per row per layer (explicit, whatever GrpcBackend's default)."""

    def attend_prefill_batch(self, seq_ids, layer, qs, ks, vs, token_ids):  # type: ignore[no-untyped-def]
        return [
            self._seqs[sid].attend_prefill(layer, q, k, v, None if token_ids is None else token_ids[i]).out
            for i, (sid, q, k, v) in enumerate(zip(seq_ids, qs, ks, vs, strict=True))
        ]


class BatchedBackend(GrpcBackend):
    """One AttendPrefillBatch rpc per layer for all rows (explicit, whatever GrpcBackend's default)."""

    def attend_prefill_batch(self, seq_ids, layer, qs, ks, vs, token_ids):  # type: ignore[no-untyped-def]
        counts = [q.shape[0] for q in qs]
        tokens = None if token_ids is None else [t for row in token_ids for t in row]
        seqs = [self._seqs[sid] for sid in seq_ids]
        out = self.client.attend_prefill_batch(
            seqs, layer, counts, torch.cat(list(qs)), torch.cat(list(ks)), torch.cat(list(vs)), tokens
        ).out
        return list(out.split(counts))


class PhaseTimer:
    """Wall time per phase of the cached path, by wrapping the calls it makes (profile pass only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed_call)


def bulk_calls(backend: GrpcBackend) -> int:
    """Attend / AttendPrefillBatch calls this backend's client answered over the bulk channel."""
    channel = backend.client.data.bulk
    return 0 if channel is None else channel.num_calls


def same_host_calls(backend: GrpcBackend) -> int:
    """Of bulk_calls, those that took the node's same-host shared-memory path."""
    channel = backend.client.data.bulk
    return 0 if channel is None else getattr(channel, "num_local_calls", 0)


def profile_cached(
    model: Any, config: Any, prefix: torch.Tensor, suffix: int, repeats: int, client_config: ClientConfig
) -> dict:
    """Median ms per phase of the cached TTFT, in-process node (its engine is reachable to wrap),
    with the data calls on the transport `client_config` picks (checked)."""
    from pagedkv.cache_node import engine as engine_module

    spec = node_spec(config)
    engine = CacheEngine(EngineConfig(spec, NUM_BLOCKS, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    phases: dict[str, list[float]] = {}
    # the kernel call the engine makes (paged_prefill before the engine checked its input once)
    kernel_name = "prefill_trusted" if hasattr(engine_module, "prefill_trusted") else "paged_prefill"
    kernel = getattr(engine_module, kernel_name)
    try:
        with GrpcBackend(f"127.0.0.1:{port}", client_config) as backend, torch.no_grad():
            timer = PhaseTimer()
            timer.wrap(backend, "open", "open rpc (client wall)")
            timer.wrap(backend, "attend_prefill_batch", CALLS)
            timer.wrap(engine, "attend_prefill", ENGINE)
            timer.wrap(engine_module, kernel_name, "node paged_prefill (gather + flash)")
            for r in range(repeats + 1):
                timer.seconds.clear()
                prompt = torch.cat([prefix, tokens(500 + r, suffix)], 1)
                with PagedKVCache(model, backend) as cache:
                    total, _ = timed(
                        lambda c=cache, p=prompt: prefill_with_prefix_cache(model, c, p, logits_to_keep=1)
                    )
                if r == 0:
                    continue  # warm-up
                seconds = dict(timer.seconds)
                calls = seconds[CALLS]
                seconds["total"] = total
                seconds["worker: model compute + hooks (total - open - calls)"] = (
                    total - calls - seconds["open rpc (client wall)"]
                )
                # everything in the calls but the engine's per-row work: the backend's tensor prep,
                # encode/decode, transport and the node's batch wrapper
                seconds[TRANSPORT] = calls - seconds[ENGINE]
                for k, v in seconds.items():
                    phases.setdefault(k, []).append(v * 1e3)
        over_bulk = bulk_calls(backend)
    finally:
        setattr(engine_module, kernel_name, kernel)
        server.stop(0)
    if (over_bulk > 0) != (client_config.bulk_min_bytes is not None):
        raise RuntimeError(f"profile: {over_bulk} calls over the bulk channel with {client_config}")
    return {k: statistics.median(v) for k, v in phases.items()}


def bench_model(name: str, args: argparse.Namespace, with_decode: bool) -> dict:
    shape = MODELS[name]
    model, config = demo_model(seed=0, **shape)
    spec = node_spec(config, args.block_size)
    prefix = tokens(1, args.prefix)
    n_prompt = args.prefix + args.suffix
    print(f"model {name} {shape}: {args.prefix} cached + {args.suffix} new tokens", flush=True)
    res: dict[str, list[float]] = {"local": [], "local_floor": [], "local/in-process phase": []}
    for t in TRANSPORTS:
        res[f"cached/{t}"], res[f"node_full/{t}"] = [], []
    for t in SIDE_VARIANTS:
        res[f"cached/{t}"] = []
    hits: list[int] = []
    same_first = True
    decode: dict[str, dict[str, float]] = {}
    batch_ttft: dict[str, float] = {}
    used_after: dict[str, int] = {}
    with (
        node_process(spec) as addr_p,
        node_process(spec, compute_thread=True) as addr_h,
        torch.no_grad(),
    ):
        backends = {"process": GrpcBackend(addr_p)}
        grpc_only = GrpcBackend(addr_p, GRPC_ONLY)
        cached_backends = {
            **backends,
            "process, gRPC only": grpc_only,
            GATHER: GrpcBackend(addr_p),
            ONE_THREAD: GrpcBackend(addr_h),
        }
        mode = {t: "gather" if t == GATHER else "node" for t in cached_backends}
        try:
            for t, backend in cached_backends.items():  # warm up + put the prefix in each node's cache
                with PagedKVCache(model, backend, mode=mode[t]) as cache:
                    prefill_with_prefix_cache(model, cache, torch.cat([prefix, tokens(2, args.suffix)], 1))
            model(tokens(3, 64), cache=DynamicCache(config=config))
            floor_cache = DynamicCache(config=config)  # the prefix's K/V already local (filled once)
            model(prefix, cache=floor_cache)
            for r in range(args.repeats):
                prompt = torch.cat([prefix, tokens(100 + r, args.suffix)], 1)
                firsts = []
                # the side variants share the process node: suffixes of their own, so no variant's
                # suffix blocks become another's prefix hit
                own = {
                    t: torch.cat([prefix, tokens(seed + r, args.suffix)], 1)
                    for t, seed in SIDE_VARIANTS.items()
                }
                order = list(cached_backends.items())
                for t, backend in order if r % 2 == 0 else order[::-1]:
                    p_t = own.get(t, prompt)
                    with PagedKVCache(model, backend, mode=mode[t]) as cache:
                        dt, out = timed(
                            lambda c=cache, p=p_t: prefill_with_prefix_cache(model, c, p, logits_to_keep=1)
                        )
                    res[f"cached/{t}"].append(dt)
                    hits.append(out.num_cached_tokens[0])
                    if p_t is prompt:
                        firsts.append(out.logits[:, -1].argmax(-1))
                dt, logits = timed(
                    lambda p=prompt: model(p, cache=DynamicCache(config=config), logits_to_keep=1).logits
                )
                res["local"].append(dt)
                same_first &= all(torch.equal(f, logits[:, -1].argmax(-1)) for f in firsts)
                res["local_floor"].append(local_floor(model, floor_cache, prompt[:, args.prefix :]))
                unique = tokens(200 + r, n_prompt)  # nothing cached: every position through the node
                for t, backend in backends.items():
                    res[f"node_full/{t}"].append(node_recompute(model, backend, unique))
                print(
                    f"  repeat {r + 1}/{args.repeats}: "
                    + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in res.items() if v)
                    + f" (hit {hits[-1]} tokens)",
                    flush=True,
                )
            if (
                with_decode
            ):  # a batch of 8 cached prompts: one AttendPrefillBatch per layer vs one rpc per row
                rows = 8
                batch8: dict[str, list[float]] = {"batched rpc": [], "per-row rpcs": [], "local": []}
                batch_fed: set[int] = set()
                with PerRowBackend(addr_p) as per_row, BatchedBackend(addr_p) as batched:
                    for r in range(max(1 if args.smoke else 5, args.repeats // 2)):
                        variants = [("batched rpc", batched), ("per-row rpcs", per_row)]
                        for v, (label, backend) in enumerate(variants if r % 2 == 0 else variants[::-1]):
                            # a suffix of its own: one variant's blocks must not be the other's prefix hit
                            suffix = tokens(400 + 10 * r + v, args.suffix, rows)
                            prompt = torch.cat([prefix.expand(rows, -1), suffix], 1)
                            with PagedKVCache(model, backend) as cache:
                                dt, out = timed(
                                    lambda c=cache, p=prompt: prefill_with_prefix_cache(
                                        model, c, p, logits_to_keep=1
                                    )
                                )
                            batch8[label].append(dt)
                            batch_fed.add(out.num_fed_tokens)
                        dt, _ = timed(
                            lambda p=prompt: model(p, cache=DynamicCache(config=config), logits_to_keep=1)
                        )
                        batch8["local"].append(dt)
                batch_ttft = {k: statistics.median(v) * 1e3 for k, v in batch8.items()}
                batch_ttft["fed_tokens_per_row"] = float(max(batch_fed))
                if batch_fed != {args.suffix}:
                    raise RuntimeError(
                        f"batch-8 prompts fed {batch_fed} tokens, not the {args.suffix} suffix"
                    )
                print(
                    "  batch 8 TTFT (node process): "
                    + ", ".join(
                        f"{k} {v:.1f} ms" for k, v in batch8.items() and batch_ttft.items() if k in batch8
                    ),
                    flush=True,
                )
            for rows in (1, 8) if with_decode else ():
                secs: dict[str, list[float]] = {"local": [], **{t: [] for t in backends}}
                for r in range(max(1 if args.smoke else 3, args.repeats // 2)):
                    prompt = torch.cat([prefix.expand(rows, -1), tokens(300 + r, args.suffix, rows)], 1)
                    for t, backend in backends.items():
                        with PagedKVCache(model, backend) as cache:
                            first = prefill_with_prefix_cache(model, cache, prompt).logits[:, -1:].argmax(-1)
                            secs[t].append(decode_steps(model, cache, first, args.decode))
                    dyn = DynamicCache(config=config)
                    first = model(prompt, cache=dyn).logits[:, -1:].argmax(-1)
                    secs["local"].append(decode_steps(model, dyn, first, args.decode))
                decode[f"batch_{rows}"] = {
                    f"{k}_tokens_per_s": rows * args.decode / statistics.median(v) for k, v in secs.items()
                }
                print(
                    f"  decode batch {rows}: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in decode[f"batch_{rows}"].items()),
                    flush=True,
                )
            for t, backend in backends.items():
                backend.check_integrity()
                used_after[t] = backend.stats()["used_blocks"]
            attending = {t: b for t, b in cached_backends.items() if t != GATHER}  # gather: no attend calls
            calls_over_bulk = {t: bulk_calls(b) for t, b in attending.items()}
            calls_same_host = {t: same_host_calls(b) for t, b in attending.items()}
            if not calls_over_bulk["process"] or calls_over_bulk["process, gRPC only"]:
                raise RuntimeError(f"data calls over the bulk channel per backend: {calls_over_bulk}")
        finally:
            for backend in cached_backends.values():
                backend.close()
    # The node inside the worker's process comes last, on its own: its handler threads' torch
    # thread pools make libgomp throttle the worker's own (every op then wakes its threads through
    # the kernel), which slowed the worker's compute in every variant measured beside it (the
    # 8-layer floor 41 -> 57 ms) and stays so while those threads live.
    print("  the node in the worker's process", flush=True)
    with node_in_process(spec) as addr_i, GrpcBackend(addr_i) as backend, torch.no_grad():
        with PagedKVCache(model, backend) as cache:
            prefill_with_prefix_cache(model, cache, torch.cat([prefix, tokens(2, args.suffix)], 1))
        for r in range(args.repeats):
            prompt = torch.cat([prefix, tokens(100 + r, args.suffix)], 1)
            with PagedKVCache(model, backend) as cache:
                dt, out = timed(
                    lambda c=cache, p=prompt: prefill_with_prefix_cache(model, c, p, logits_to_keep=1)
                )
            res["cached/in-process"].append(dt)
            hits.append(out.num_cached_tokens[0])
            dt, _ = timed(lambda p=prompt: model(p, cache=DynamicCache(config=config), logits_to_keep=1))
            res["local/in-process phase"].append(dt)
            res["node_full/in-process"].append(node_recompute(model, backend, tokens(200 + r, n_prompt)))
        backend.check_integrity()
        used_after["in-process"] = backend.stats()["used_blocks"]
        calls_over_bulk["in-process"] = bulk_calls(backend)
        calls_same_host["in-process"] = same_host_calls(backend)
        if not calls_over_bulk["in-process"]:
            raise RuntimeError("in-process node: no data call over the bulk channel")
    print("  profiling the cached path (in-process node)", flush=True)
    phases = profile_cached(model, config, prefix, args.suffix, args.repeats, ClientConfig())
    phases_grpc = profile_cached(model, config, prefix, args.suffix, args.repeats, GRPC_ONLY)
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    return {
        "model": shape,
        "ttft_ms": med,
        "ratio_cached_vs_local_recompute": {
            t: med[f"cached/{t}"] / med["local/in-process phase" if t == "in-process" else "local"]
            for t in (*TRANSPORTS, *SIDE_VARIANTS)
        },
        "ratio_cached_vs_node_recompute": {t: med[f"cached/{t}"] / med[f"node_full/{t}"] for t in TRANSPORTS},
        "raw_ms": {k: [x * 1e3 for x in v] for k, v in res.items()},
        "cached_prefix_hit_tokens": hits,
        "first_token_matches_recompute": same_first,
        "decode": decode,
        "batch_8_ttft_ms_node_process": batch_ttft,
        "cached_phases_ms": phases,
        "cached_phases_grpc_only_ms": phases_grpc,
        "data_calls_over_bulk_channel": calls_over_bulk,
        "of_which_same_host_shared_memory": calls_same_host,
        "node_used_blocks_after": used_after,
    }


def main(argv: list[str] | None = None) -> None:
    from bench.ttft_report import plot, render  # it reads this module's constants

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-large", action="store_true", help="only the small model")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument(
        "--smoke", action="store_true", help="every path once on tiny prompts, the small model only (CI)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats, args.prefix, args.suffix, args.decode, args.no_large = 1, 64, 16, 2, True
    torch.manual_seed(0)
    names = ["small"] if args.no_large else ["small", "large"]
    load_start = [round(x, 2) for x in os.getloadavg()]
    report = {
        "models": {name: bench_model(name, args, with_decode=name == "small") for name in names},
        "dtype": "float32",
        "block_size": args.block_size,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "repeats": args.repeats,
        "goal_ratio": 0.3,
        "decode_steps": args.decode,
        "machine": {
            "cpu_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "omp_wait": " ".join(
                f"{k}={os.environ.get(k, 'unset')}" for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
            ),
        },
        "transports": {
            "process": "the node in its own process (pagedkv node), as deployed; control calls over gRPC, "
            "data calls over its bulk TCP channel (localhost)",
            "in-process": "the node's server in the worker's process (shared GIL); same transports",
            "process, gRPC only": "the node process, every call over gRPC (bulk_min_bytes=None)",
            GATHER: "the node process, PagedKVCache(mode='gather'): the cached prefix's K/V read back "
            "(ReadKV) and attention in the worker; the suffix's K/V appended after the forward",
            ONE_THREAD: "a second node process run with --compute-thread on: every engine call on one "
            "thread of the node's (one torch thread pool, spinning between ops)",
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "ttft.md").write_text(render(report))
    plot(report, args.out / "ttft.png")
    print(render(report))


if __name__ == "__main__":
    main()
