"""What the score modifiers (AttentionSpec) cost or save in paged decode on CPU (fp32).

    .venv/bin/python -m bench.attention_mods [--length 8192] [--repeats 30]

Batch 8, 32 query heads, 8 KV heads, head_dim 128, block size 16, shuffled blocks. Variants, timed
in rotating order inside each repeat (the machine is shared): plain, a window of length / 8,
soft-cap + sinks (the extra work on every score), and all three, on the C++ kernel and the torch
path. Prints median ms and the ratio to the same backend's plain call in the same repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedkv.cache_node.attention import AttentionSpec, kernel_info, paged_decode

BATCH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
