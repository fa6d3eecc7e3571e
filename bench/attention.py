"""Paged decode attention vs contiguous torch SDPA on the same data (fp32, CPU).

    cd /work/main && .venv/bin/python -m bench.attention [--quick]

Batch 8, 32 query heads, head_dim 128, L = 512 / 2048 / 8192, MHA (32 KV heads) and GQA (8 KV
heads); block size 16 with shuffled physical block ids. Variants, timed in rotating order inside each
repeat (the machine is shared and noisy, so no variant gets a quiet or a busy stretch to itself):

- sdpa:         F.scaled_dot_product_attention on contiguous [B, H, L, D] K/V (MHA)
- sdpa_gqa:     the same with enable_gqa=True (GQA)
- folded:       contiguous matmul with the G query heads of each KV head folded into M (GQA)
- paged_kernel: paged_decode, C++ kernel
- paged_torch:  paged_decode, torch fallback (gather + folded bmm)

The baseline of each shape is sdpa (MHA) or sdpa_gqa (GQA); the goal is paged_kernel <= 1.15x it.
Writes bench/results/attention.{json,md} and attention.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import plots
from pagedkv.cache_node.attention import cpu_kernel, kernel_info, paged_decode

RESULTS = Path(__file__).with_name("results")
BATCH, NUM_Q_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 128, 16
GOAL_RATIO = 1.15
SECONDS_PER_SHAPE = 10.0  # repeats are sized to about this much timing per shape


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _cold_build() -> tuple[float | None, str]:
    """Compile the kernel into an empty directory, as a fresh clone in CI would: (seconds, flags)."""
    saved = os.environ.get("PAGEDKV_KERNEL_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PAGEDKV_KERNEL_DIR"] = tmp
        try:
            fn, info = cpu_kernel._build_kernel()
        finally:
            if saved is None:
                del os.environ["PAGEDKV_KERNEL_DIR"]
            else:
                os.environ["PAGEDKV_KERNEL_DIR"] = saved
    flags = info.detail.split("built with ", 1)[-1].rstrip(")") if fn is not None else info.detail
    return (info.build_s if fn is not None else None), flags


def _make_variants(seq_len: int, num_kv_heads: int) -> tuple[dict[str, Callable[[], torch.Tensor]], float]:
    gen = torch.Generator().manual_seed(seq_len + num_kv_heads)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = BATCH * blocks_per_seq
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(BATCH, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((BATCH,), seq_len)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [B, Hk, L, D], the same values
        blocks = cache[tables.long()]  # [B, blocks, Hk, bs, D]
        return blocks.permute(0, 2, 1, 3, 4).reshape(BATCH, num_kv_heads, seq_len, HEAD_DIM).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    q = torch.randn(BATCH, NUM_Q_HEADS, HEAD_DIM, generator=gen)
    q4 = q.unsqueeze(2).contiguous()  # [B, Hq, 1, D]
    group = NUM_Q_HEADS // num_kv_heads
    scale = HEAD_DIM**-0.5

    def folded() -> torch.Tensor:
        qf = q.view(BATCH * num_kv_heads, group, HEAD_DIM)
        kf, vf = k.view(-1, seq_len, HEAD_DIM), v.view(-1, seq_len, HEAD_DIM)
        probs = torch.bmm(qf, kf.transpose(1, 2)).mul_(scale).softmax(-1)
        return torch.bmm(probs, vf).view(BATCH, NUM_Q_HEADS, HEAD_DIM)

    variants: dict[str, Callable[[], torch.Tensor]] = {}
    if group == 1:
        variants["sdpa"] = lambda: F.scaled_dot_product_attention(q4, k, v).squeeze(2)
    else:
        variants["sdpa_gqa"] = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)
        variants["folded"] = folded
    if kernel_info().is_available:
        variants["paged_kernel"] = lambda: (
            paged_decode(q, k_cache, v_cache, tables, seq_lens, backend="kernel").out
        )
    variants["paged_torch"] = lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, backend="torch").out
    # Everything must agree before anything is timed.
    expected = next(iter(variants.values()))()
    max_err = max(float((fn() - expected).abs().max()) for fn in variants.values())
    return variants, max_err


def _time_shape(variants: dict[str, Callable[[], torch.Tensor]], budget_s: float) -> dict[str, list[float]]:
    names = list(variants)
    start = time.perf_counter()
    for name in names:  # warm-up (and a first estimate of one round)
        variants[name]()
    round_s = time.perf_counter() - start
    repeats = max(7, min(60, int(budget_s / max(round_s, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            variants[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
        if sys.stdout.isatty():
            print(f"\r    repeat {r + 1}/{repeats}", end="", flush=True)
    print("\r" if sys.stdout.isatty() else f"    {repeats} repeats", end="" if sys.stdout.isatty() else "\n")
    return samples


def _summary(times_ms: list[float], baseline_ms: list[float]) -> dict[str, float]:
    """Quartiles of one variant, and its ratio to the baseline as the median of per-repeat ratios:
    the two ran back to back in each repeat, so a neighbour's load drifting over the run cancels."""
    q1, median, q3 = statistics.quantiles(times_ms, n=4)
    paired = [t / b for t, b in zip(times_ms, baseline_ms, strict=True)]
    return {
        "median_ms": round(median, 3),
        "p25_ms": round(q1, 3),
        "p75_ms": round(q3, 3),
        "min_ms": round(min(times_ms), 3),
        "ratio": round(statistics.median(paired), 3),
        "ratio_of_medians": round(median / statistics.median(baseline_ms), 3),
        "repeats": len(times_ms),
    }


def run(seq_lens: list[int]) -> dict:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {_cpu_model()}")
    print("compiling the kernel from scratch (as a fresh clone would) ...", flush=True)
    cold_build_s, flags = _cold_build()
    info = kernel_info()
    print(
        f"  cold compile: {cold_build_s if cold_build_s is None else round(cold_build_s, 2)} s; "
        f"kernel available: {info.is_available} ({info.detail})"
    )
    shapes = []
    for seq_len in seq_lens:
        for num_kv_heads in (NUM_Q_HEADS, 8):
            label = f"L={seq_len} {'MHA' if num_kv_heads == NUM_Q_HEADS else 'GQA'} (Hk={num_kv_heads})"
            print(f"  {label}: building data ...", flush=True)
            load_before = os.getloadavg()[0]
            variants, max_err = _make_variants(seq_len, num_kv_heads)
            samples = _time_shape(variants, SECONDS_PER_SHAPE)
            baseline = "sdpa" if num_kv_heads == NUM_Q_HEADS else "sdpa_gqa"
            summaries = {name: _summary(t, samples[baseline]) for name, t in samples.items()}
            row = {
                "seq_len": seq_len,
                "num_kv_heads": num_kv_heads,
                "baseline": baseline,
                "max_abs_diff": max_err,
                "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "variants": summaries,
            }
            shapes.append(row)
            print(
                f"  {label}: "
                + ", ".join(f"{n} {s['median_ms']:.2f} ms ({s['ratio']:.2f}x)" for n, s in summaries.items()),
                flush=True,
            )
            del variants
    return {
        "meta": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": _cpu_model(),
            "python": sys.version.split()[0],
            "kernel_available": info.is_available,
            "kernel_cold_compile_s": None if cold_build_s is None else round(cold_build_s, 2),
            "kernel_flags": flags,
            "shape": {
                "batch": BATCH,
                "num_q_heads": NUM_Q_HEADS,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE,
            },
            "dtype": "float32",
            "goal_ratio": GOAL_RATIO,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "shapes": shapes,
    }


VARIANTS = ["sdpa", "sdpa_gqa", "folded", "paged_kernel", "paged_torch"]


def to_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "# Paged decode attention vs contiguous SDPA",
        "",
        f"fp32, batch {meta['shape']['batch']}, {meta['shape']['num_q_heads']} query heads, head_dim "
        f"{meta['shape']['head_dim']}, block size {meta['shape']['block_size']} (shuffled physical blocks); "
        f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}; {meta['date']}. "
        f"Median ms over repeats that run every variant in rotating order; ratio = median over repeats "
        f"of time / the same repeat's SDPA baseline (sdpa for MHA, sdpa_gqa for GQA). "
        f"Goal: paged_kernel <= {meta['goal_ratio']}x. Kernel cold compile: "
        f"{meta['kernel_cold_compile_s']} s (`{meta['kernel_flags']}`).",
        "",
        "| shape | " + " | ".join(VARIANTS) + " | goal | load 1m |",
        "|---|" + "---|" * (len(VARIANTS) + 2),
    ]
    for row in report["shapes"]:
        kind = "MHA" if row["num_kv_heads"] == meta["shape"]["num_q_heads"] else "GQA"
        cells = []
        for name in VARIANTS:
            s = row["variants"].get(name)
            cells.append("—" if s is None else f"{s['median_ms']:.1f} ({s['ratio']:.2f}x)")
        kernel = row["variants"].get("paged_kernel")
        goal = "—" if kernel is None else ("met" if kernel["ratio"] <= meta["goal_ratio"] else "**missed**")
        load = "→".join(str(x) for x in row["loadavg_1m"])
        lines.append(f"| L={row['seq_len']} {kind} | " + " | ".join(cells) + f" | {goal} | {load} |")
    lines += ["", "## Findings", "", findings(report), ""]
    return "\n".join(lines)


def findings(report: dict) -> str:
    rows = report["shapes"]
    kernel = [r["variants"]["paged_kernel"]["ratio"] for r in rows if "paged_kernel" in r["variants"]]
    fallback = [r["variants"]["paged_torch"]["ratio"] for r in rows]
    gqa = [r for r in rows if r["baseline"] == "sdpa_gqa" and "paged_kernel" in r["variants"]]
    met = sum(ratio <= report["meta"]["goal_ratio"] for ratio in kernel)
    parts = []
    if kernel:
        parts.append(
            f"The C++ kernel runs at {min(kernel):.2f}–{max(kernel):.2f}x the contiguous SDPA time and meets "
            f"the {report['meta']['goal_ratio']}x goal on {met} of {len(kernel)} shapes, without gathering: "
            "it walks each sequence's blocks in place with an online softmax, all query heads of a KV head "
            "together, so every K/V byte is read once and decode stays memory-bound like SDPA itself."
        )
    if gqa:
        vs_folded = [
            r["variants"]["paged_kernel"]["median_ms"] / r["variants"]["folded"]["median_ms"] for r in gqa
        ]
        parts.append(
            "For GQA, torch's enable_gqa path is the slow one (its CPU flash kernel walks K/V once per query "
            "head, so each KV head is read G = 4 times: from L2 while a head's K/V fit, 256 KB each at "
            "L=512, from memory at L=8192, where its K/V are 4 MB each); the kernel is "
            f"{min(r['variants']['paged_kernel']['ratio'] for r in gqa):.2f}–"
            f"{max(r['variants']['paged_kernel']['ratio'] for r in gqa):.2f}x of it and "
            f"{min(vs_folded):.2f}–{max(vs_folded):.2f}x of the folded contiguous matmul."
        )
    parts.append(
        f"The torch fallback is {min(fallback):.2f}–{max(fallback):.2f}x: the gather into a contiguous "
        "buffer alone costs about as much as the whole SDPA (it reads and writes all of K and V once "
        "more); pooling the gather buffers matters, since a fresh 100+ MB tensor per call pays "
        "first-touch page faults (about 5x slower gathers). The machine is a shared 2-core VM: "
        "numbers move by 2x or more between runs when a neighbour is busy (see the load column), so "
        "ratios from one run, with variants interleaved, are the meaningful figures, not absolute ms."
    )
    return " ".join(parts)


def plot(report: dict, path: Path) -> bool:
    plt = plots.pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import FormatStrFormatter

    rows = report["shapes"]
    labels = [f"L={r['seq_len']}\n{'MHA' if r['baseline'] == 'sdpa' else 'GQA'}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(VARIANTS)
    for i, name in enumerate(VARIANTS):
        xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j, r in enumerate(rows) if name in r["variants"]]
        ys = [r["variants"][name]["ratio"] for r in rows if name in r["variants"]]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(report["meta"]["goal_ratio"], color="k", linestyle="--", linewidth=1, label="goal 1.15x")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("time / contiguous SDPA (median of paired ratios)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
    ax.set_title("Paged decode attention, fp32, B=8, Hq=32, D=128, block 16 (lower is better)")
    ax.legend(fontsize=8, ncol=3)
    plots.save(fig, path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="L=512 and 2048 only, shorter timing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--smoke", action="store_true", help="L=128 only, the fewest repeats (CI)")
    parser.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    global SECONDS_PER_SHAPE
    if args.quick or args.smoke:
        SECONDS_PER_SHAPE = 0.0 if args.smoke else 3.0
    report = run([128] if args.smoke else [512, 2048] if args.quick else [512, 2048, 8192])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "attention.md").write_text(to_markdown(report))
    plotted = plot(report, args.out / "attention.png")
    print()
    print(to_markdown(report))
    print(
        f"\nwrote {args.out / 'attention.json'}, {args.out / 'attention.md'}"
        + (f", {args.out / 'attention.png'}" if plotted else " (no matplotlib: no plot)")
    )


if __name__ == "__main__":
    main()
