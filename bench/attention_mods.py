"""What the score modifiers (AttentionSpec) cost or save in paged decode on CPU (fp32).

    .venv/bin/python -m bench.attention_mods [--length 8192] [--repeats 30]
    .venv/bin/python -m bench.attention_mods --engine BASE [--rounds 5]

The kernels: batch 8, 32 query heads, 8 KV heads, head_dim 128, block size 16, shuffled blocks.
Variants, timed in rotating order inside each repeat (the machine is shared): plain, a window of
length / 8, soft-cap + sinks (the extra work on every score), and all three, on the C++ kernel
and the torch path. Prints median ms and the ratio to the same backend's plain call in the same
repeat.

`--engine BASE`: a whole decode step (CacheEngine.attend_decode of every layer, appending) of
plain sequences, this tree against the tree at BASE (e.g. `git archive main | tar -x -C BASE`),
each in its own process (one torch thread), alternating, `--rounds` times; then this tree's step
with a window of length / 8 and the blocks a sequence holds as it decodes. Writes
results/attention_mods_engine.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedkv.cache_node.attention import AttentionSpec, kernel_info, paged_decode

BATCH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--engine", metavar="BASE", help="a tree to compare the engine's decode step with")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.engine:
        engine_ab(Path(args.engine), args.rounds)
        return
    kernel_info()
    gen = torch.Generator().manual_seed(0)
    length = args.length
    num_blocks = BATCH * length // BLOCK_SIZE
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(BATCH, -1).to(torch.int32)
    lens = torch.full((BATCH,), length)
    q = torch.randn(BATCH, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    sinks = tuple(float(x) for x in torch.linspace(-1, 1, NUM_Q_HEADS))
    specs = {
        "plain": AttentionSpec(),
        f"window {length // 8}": AttentionSpec(window=length // 8),
        "softcap+sinks": AttentionSpec(softcap=30.0, sinks=sinks),
        "all three": AttentionSpec(window=length // 8, softcap=30.0, sinks=sinks),
    }
    variants = [(backend, name) for backend in ("kernel", "torch") for name in specs]
    times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    ratios: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    for key in variants:  # warm up (builds, pooled buffers)
        paged_decode(q, k, v, tables, lens, backend=key[0], spec=specs[key[1]])  # type: ignore[arg-type]
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        this: dict[tuple[str, str], float] = {}
        for key in order:
            start = time.perf_counter()
            paged_decode(q, k, v, tables, lens, backend=key[0], spec=specs[key[1]])  # type: ignore[arg-type]
            this[key] = time.perf_counter() - start
        for key in variants:
            times[key].append(this[key])
            ratios[key].append(this[key] / this[(key[0], "plain")])
    load_after = os.getloadavg()[0]
    print(
        f"L={length}, batch {BATCH}, {NUM_Q_HEADS}/{NUM_KV_HEADS} heads, D {HEAD_DIM}, "
        f"{torch.get_num_threads()} threads, load {load_before:.2f} -> {load_after:.2f}"
    )
    print("| backend | spec | median ms | vs plain |\n|---|---|---:|---:|")
    for key in variants:
        med, ratio = statistics.median(times[key]) * 1e3, statistics.median(ratios[key])
        print(f"| {key[0]} | {key[1]} | {med:.1f} | {ratio:.2f}x |")


# -- the engine's decode step, this tree against another ------------------------------------

# Shapes of the engine A/B: (batch, context length). Batch 1 at 64 tokens is all per-call
# overhead (what the per-sequence spec lookup could slow); batch 8 at 1,024 is mostly attention.
ENGINE_CASES = [(1, 64), (8, 1024)]
ENGINE_STEPS = 100

# Runs in a fresh interpreter whose `pagedkv` is the tree at ROOT (sys.argv[1]; "" = installed).
_WORKER = r"""
import json, statistics, sys, time
if sys.argv[1]:
    sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.path.insert(0, sys.argv[1])
import torch
torch.manual_seed(0)
torch.set_num_threads(1)  # two processes' thread pools on a shared machine: timing noise, not signal
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.protos.spec import ModelSpec
cases, steps, window = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16)
out = []
for batch, length in cases:
    engine = CacheEngine(EngineConfig(spec, batch * (length + steps + 64) // 16 + 64, device="cpu"))
    kw = {}
    if window:
        from pagedkv.protos.attention import LayerAttention
        kw = {"attention": [LayerAttention(window=length // 8)] * spec.num_layers}
    ids = [f"s{b}" for b in range(batch)]
    for b, sid in enumerate(ids):
        tokens = [b * 100000 + i for i in range(length)]
        engine.open(sid, tokens, **kw)
        k = torch.randn(2, length, 2, 64)
        engine.append(sid, tokens, k, k)
    q, kv = torch.randn(batch, 8, 64), torch.randn(batch, 2, 64)
    times, held = [], []
    for step in range(steps + 20):
        t0 = time.perf_counter()
        for layer in range(spec.num_layers):
            engine.attend_decode(ids, layer, q, kv, kv, [step] * batch if layer == 0 else None)
        if step >= 20:
            times.append(time.perf_counter() - t0)
            held.append(len(engine.block_table(ids[0])))
    out.append({"median_us": statistics.median(times) * 1e6, "held": held})
print(json.dumps(out))
"""


def _worker(root: str, window: int) -> list[dict]:
    args = [sys.executable, "-c", _WORKER, root, json.dumps(ENGINE_CASES), str(ENGINE_STEPS), str(window)]
    done = subprocess.run(args, capture_output=True, text=True, check=True, cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def engine_ab(base: Path, rounds: int) -> None:
    if not (base / "cache_node" / "engine.py").exists():
        raise SystemExit(f"{base} is not a pagedkv tree (no cache_node/engine.py)")
    link = Path(f"/tmp/pagedkv-bench-base-{os.getpid()}")
    link.mkdir(exist_ok=True)
    (link / "pagedkv").unlink(missing_ok=True)
    (link / "pagedkv").symlink_to(base.resolve())
    load_before = os.getloadavg()[0]
    base_us: list[list[float]] = [[] for _ in ENGINE_CASES]
    this_us: list[list[float]] = [[] for _ in ENGINE_CASES]
    ratios: list[list[float]] = [[] for _ in ENGINE_CASES]
    for r in range(rounds):  # alternate which tree runs first: the machine is shared
        order = [("base", str(link)), ("this", "")] if r % 2 == 0 else [("this", ""), ("base", str(link))]
        got = {name: _worker(root, 0) for name, root in order}
        for i in range(len(ENGINE_CASES)):
            base_us[i].append(got["base"][i]["median_us"])
            this_us[i].append(got["this"][i]["median_us"])
            ratios[i].append(this_us[i][-1] / base_us[i][-1])
        print(
            f"round {r + 1}/{rounds}: " + ", ".join(f"{x:.3f}x" for x in (rs[-1] for rs in ratios)),
            flush=True,
        )
    windowed = _worker("", 1)
    plain = _worker("", 0)
    lookup_ns = _lookup_ns()
    load_after = os.getloadavg()[0]
    lines = [
        f"Decode step (2 layers, 8/2 heads, D 64, blocks of 16), medians of {ENGINE_STEPS} steps per "
        f"process, {rounds} rounds alternating; load {load_before:.2f} -> {load_after:.2f}.",
        "",
        "| batch x L | base us | this us | this / base (rounds) | window L/8 us | blocks held plain/window |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for i, (batch, length) in enumerate(ENGINE_CASES):
        b_us, t_us = statistics.median(base_us[i]), statistics.median(this_us[i])
        lines.append(
            f"| {batch} x {length} | {b_us:.0f} | {t_us:.0f} | "
            f"{statistics.median(ratios[i]):.3f}x ({min(ratios[i]):.3f}-{max(ratios[i]):.3f}) | "
            f"{windowed[i]['median_us']:.0f} | {plain[i]['held'][-1]} / {windowed[i]['held'][-1]} |"
        )
    lines += [
        "",
        f"The spec lookup a plain batch adds per layer call: {lookup_ns:.0f} ns (SequenceSpecs.batch_specs).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    results = Path(__file__).parent / "results"
    (results / "attention_mods_engine.md").write_text(text)
    raw = {
        "cases": ENGINE_CASES,
        "load": [load_before, load_after],
        "base_us": base_us,
        "this_us": this_us,
        "ratios": ratios,
        "plain": plain,
        "window": windowed,
        "lookup_ns": lookup_ns,
    }
    (results / "attention_mods_engine.json").write_text(json.dumps(raw, indent=1) + "\n")
    _plot(results / "attention_mods_engine.png", base_us, this_us, plain, windowed)


def _lookup_ns() -> float:
    """What the per-sequence spec costs a batch of plain sequences per layer call."""
    import timeit

    from pagedkv.cache_node.windows import SequenceSpecs

    specs, ids = SequenceSpecs(2, 16), [f"s{b}" for b in range(8)]
    n = 200_000
    seqs = [None] * len(ids)  # (read only for sequences with a spec: none here)
    return min(timeit.repeat(lambda: specs.batch_specs(ids, 1, seqs), number=n, repeat=5)) / n * 1e9


def _plot(path: Path, base_us: list, this_us: list, plain: list, windowed: list) -> None:
    from .plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [f"{b} x {n}" for b, n in ENGINE_CASES]
    xs = range(len(labels))
    left.bar([x - 0.2 for x in xs], [statistics.median(v) for v in base_us], 0.4, label="base")
    left.bar([x + 0.2 for x in xs], [statistics.median(v) for v in this_us], 0.4, label="this tree")
    left.set_xticks(list(xs), labels)
    left.set_yscale("log")
    left.set_ylabel("decode step, us (median)")
    left.set_title("plain sequences")
    left.legend()
    for i, (batch, length) in enumerate(ENGINE_CASES):
        steps = range(1, len(plain[i]["held"]) + 1)
        right.plot(steps, plain[i]["held"], label=f"{batch} x {length} plain")
        right.plot(steps, windowed[i]["held"], label=f"{batch} x {length} window {length // 8}")
    right.set_xlabel("tokens decoded")
    right.set_ylabel("blocks one sequence holds")
    right.set_yscale("log")
    right.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
