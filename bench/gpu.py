"""The node on a CUDA device: Triton paged attention and the pool's tier moves (one run, ~2 min).

    python -m bench.gpu [--quick] [--out bench/results]

- copy:    the device's own bandwidth, a torch device-to-device copy of 2 GiB (read + write bytes
           per second): the roofline decode is measured against.
- decode:  paged decode, bf16, 32 query / 8 KV heads, head_dim 128, block size 16, shuffled
           blocks, batch 1-64 x L 1k-32k. KV bytes read per second for the Triton kernel alone,
           for the public `paged_decode` (its checks and host syncs included) and for torch SDPA
           (`enable_gqa`) on a contiguous cache of the same values. L2 is flushed before each call.
- prefill: one sequence, n new tokens over its cache (n = context: a fresh prompt; and a suffix
           of 512 after 8k cached), Triton against torch's flash SDPA on contiguous K/V (TFLOP/s
           of the causal work).
- swap:    TensorMover moving 1 GiB of blocks (a 32-layer model's pool) device -> host and back,
           against one pinned host copy of 1 GiB each way.

Goals (issue 21): decode >= 60% of the copy bandwidth at batch >= 8, L >= 4k; prefill >= 0.8x
flash SDPA. Writes gpu.json, gpu.md and gpu.png under --out. Exits with a message and status 2
when there is no CUDA device or no compiled Triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import plots
from pagedkv.cache_node.attention import paged_decode
from pagedkv.cache_node.attention import triton_backend as triton_attention
from pagedkv.cache_node.kv_manager import DEVICE, HOST
from pagedkv.cache_node.tensor_mover import TensorMover

RESULTS = Path(__file__).with_name("results")
HQ, HK, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = D**-0.5
GIB = 1 << 30
DEV = torch.device("cuda")  # --smoke: "cpu", through Triton's interpreter


def _time_ms(fn: Callable[[], object], repeats: int, flush: torch.Tensor | None = None) -> float:
    """Median device time of fn over repeats calls (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()  # evict L2 so small caches are read from HBM, as in a real step
        if DEV.type != "cuda":
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(repeats: int, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), repeats)
    return {"bytes": 2 * src.numel(), "ms": round(ms, 3), "gb_s": round(2 * src.numel() / ms / 1e6, 1)}


def decode(batches: list[int], lengths: list[int], repeats: int, flush: torch.Tensor) -> list[dict]:
    max_blocks = max(batches) * max(lengths) // BS
    gen = torch.Generator(device=DEV).manual_seed(0)
    shape = (max_blocks, HK, BS, D)
    k_cache = torch.randn(shape, device=DEV, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device=DEV, dtype=DTYPE, generator=gen)
    rows = []
    for length in lengths:
        for batch in batches:
            blocks = length // BS
            tables = torch.randperm(max_blocks, device=DEV, generator=gen)[: batch * blocks]
            tables = tables.view(batch, blocks).to(torch.int32)
            lens = torch.full((batch,), length, dtype=torch.int32, device=DEV)
            q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE, generator=gen)
            kv_bytes = 2 * batch * length * HK * D * k_cache.element_size()

            def contiguous(
                cache: torch.Tensor, tables: torch.Tensor = tables, batch: int = batch
            ) -> torch.Tensor:
                return cache[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, HK, -1, D).contiguous()

            k, v = contiguous(k_cache), contiguous(v_cache)
            q4 = q.unsqueeze(2)

            def kernel(q=q, tables=tables, lens=lens, length=length) -> object:  # type: ignore[no-untyped-def]
                return triton_attention.decode(q, k_cache, v_cache, tables, lens, length, SCALE, False)

            def public(q=q, tables=tables, lens=lens) -> object:  # type: ignore[no-untyped-def]
                return paged_decode(q, k_cache, v_cache, tables, lens, backend="triton")

            def sdpa(q4=q4, k=k, v=v) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

            want = sdpa().squeeze(2).float()
            got = kernel()[0]
            err = float((got.float() - want).abs().max())  # type: ignore[index]
            row: dict = {"batch": batch, "seq_len": length, "kv_bytes": kv_bytes, "max_abs_err_vs_sdpa": err}
            for name, fn in (("triton_kernel", kernel), ("paged_decode", public), ("sdpa_contiguous", sdpa)):
                ms = _time_ms(fn, repeats, flush)
                row[name] = {"ms": round(ms, 4), "gb_s": round(kv_bytes / ms / 1e6, 1)}
            rows.append(row)
            print(
                f"  decode B={batch:<3} L={length:<6} kernel {row['triton_kernel']['gb_s']:>7} GB/s, "
                f"paged_decode {row['paged_decode']['gb_s']:>7}, sdpa {row['sdpa_contiguous']['gb_s']:>7} "
                f"(err {err:.1e})",
                flush=True,
            )
            del k, v
    return rows


def _flash_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def prefill(shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(1)
    for context, n in shapes:
        blocks = context // BS
        shape = (blocks, HK, BS, D)
        k_cache = torch.randn(shape, device=DEV, dtype=DTYPE, generator=gen)
        v_cache = torch.randn(shape, device=DEV, dtype=DTYPE, generator=gen)
        ids = torch.randperm(blocks, device=DEV, generator=gen).to(torch.int32)
        q = torch.randn(n, HQ, D, device=DEV, dtype=DTYPE, generator=gen)
        flops = 4 * HQ * D * (n * (n + 1) // 2 + n * (context - n))

        def kernel(q=q, k_cache=k_cache, v_cache=v_cache, ids=ids, context=context) -> object:  # type: ignore[no-untyped-def]
            return triton_attention.prefill(q, k_cache, v_cache, ids, ids.shape[0], context, SCALE, False)

        row: dict = {"context": context, "new_tokens": n, "flops": flops}
        row["triton"] = {"ms": round(_time_ms(kernel, repeats), 4)}
        if n == context:  # flash's causal mask is top-left: only a fresh prompt compares like for like

            def contiguous(cache: torch.Tensor, ids: torch.Tensor = ids) -> torch.Tensor:
                return cache[ids.long()].permute(1, 0, 2, 3).reshape(1, HK, -1, D).contiguous()

            k, v = contiguous(k_cache), contiguous(v_cache)
            qh = q.transpose(0, 1).unsqueeze(0)

            def sdpa(qh=qh, k=k, v=v) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return _flash_sdpa(qh, k, v)

            want = sdpa()[0].transpose(0, 1).float()
            row["max_abs_err_vs_sdpa"] = float((kernel()[0].float() - want).abs().max())  # type: ignore[index]
            row["sdpa_flash"] = {"ms": round(_time_ms(sdpa, repeats), 4)}
            row["ratio_sdpa_over_triton"] = round(row["sdpa_flash"]["ms"] / row["triton"]["ms"], 3)
        for name in ("triton", "sdpa_flash"):
            if name in row:
                row[name]["tflop_s"] = round(flops / row[name]["ms"] / 1e9, 1)
        rows.append(row)
        print(f"  prefill ctx={context} n={n}: {row}", flush=True)
    return rows


def swap(repeats: int, layers: int = 32) -> dict:
    num_blocks, moved = 1024, 512  # 32 layers: blocks of 2 MiB (bf16), 1 GiB moved each way
    pin = DEV.type == "cuda"
    dev = torch.zeros(layers, 2, num_blocks, HK, BS, D, dtype=DTYPE, device=DEV)
    host = torch.zeros(layers, 2, moved, HK, BS, D, dtype=DTYPE, pin_memory=pin)
    mover = TensorMover({DEVICE: dev, HOST: host})
    src = torch.randperm(num_blocks)[:moved].tolist()
    dst = torch.randperm(moved).tolist()
    nbytes = moved * dev[:, :, 0].numel() * dev.element_size()
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def wall_ms(fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    out_ms = wall_ms(lambda: mover.copy_blocks(DEVICE, src, HOST, dst))
    in_ms = wall_ms(lambda: mover.copy_blocks(HOST, dst, DEVICE, src))

    def d2h() -> None:
        flat_host.copy_(flat_dev, non_blocking=True)

    def h2d() -> None:
        flat_dev.copy_(flat_host, non_blocking=True)

    d2h_ms, h2d_ms = wall_ms(d2h), wall_ms(h2d)
    gb = nbytes / 1e6
    return {
        "bytes": nbytes,
        "chunk_blocks": mover.chunk_blocks,
        "swap_out_gb_s": round(gb / out_ms, 2),
        "swap_in_gb_s": round(gb / in_ms, 2),
        "pinned_d2h_gb_s": round(gb / d2h_ms, 2),
        "pinned_h2d_gb_s": round(gb / h2d_ms, 2),
    }


def to_markdown(report: dict) -> str:
    copy = report["copy"]["gb_s"]
    lines = [
        f"# GPU: {report['meta']['device']}",
        "",
        f"Device copy bandwidth (read + write): {copy} GB/s. "
        f"Decode, bf16, Hq {HQ} / Hk {HK}, D {D}, block {BS}:",
        "",
        "| batch | L | kernel GB/s | of copy | paged_decode GB/s | SDPA GB/s | err vs SDPA |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["decode"]:
        k = r["triton_kernel"]["gb_s"]
        lines.append(
            f"| {r['batch']} | {r['seq_len']} | {k} | {k / copy:.0%} | {r['paged_decode']['gb_s']} | "
            f"{r['sdpa_contiguous']['gb_s']} | {r['max_abs_err_vs_sdpa']:.1e} |"
        )
    lines += [
        "",
        "| prefill context | new | triton TFLOP/s | flash SDPA TFLOP/s | SDPA ms / triton ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in report["prefill"]:
        sd = r.get("sdpa_flash", {}).get("tflop_s", "-")
        ratio = r.get("ratio_sdpa_over_triton", "-")
        lines.append(f"| {r['context']} | {r['new_tokens']} | {r['triton']['tflop_s']} | {sd} | {ratio} |")
    s = report["swap"]
    lines += [
        "",
        f"Swap ({s['bytes'] / GIB:.2f} GiB of blocks): out {s['swap_out_gb_s']} GB/s, "
        f"in {s['swap_in_gb_s']} GB/s; "
        f"pinned copy D2H {s['pinned_d2h_gb_s']}, H2D {s['pinned_h2d_gb_s']} GB/s.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    copy = report["copy"]["gb_s"]
    for batch in sorted({r["batch"] for r in report["decode"]}):
        rs = [r for r in report["decode"] if r["batch"] == batch]
        xs = [r["seq_len"] for r in rs]
        ax.plot(xs, [r["triton_kernel"]["gb_s"] / copy for r in rs], marker="o", label=f"triton B={batch}")
        ax.plot(
            xs, [r["sdpa_contiguous"]["gb_s"] / copy for r in rs], ls="--", alpha=0.6, label=f"SDPA B={batch}"
        )
    ax.axhline(0.6, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_ylabel("KV read / device copy bandwidth")
    ax.set_title(f"paged decode, bf16, GQA {HQ}/{HK} ({report['meta']['device']})")
    ax.legend(fontsize=7, ncol=2)
    plots.save(fig, path)
    return True


def main() -> None:
    global DEV
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats (~30 s)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU in Triton's interpreter: checks the script, measures nothing",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args()
    if args.smoke:
        DEV = torch.device("cpu")
        if not triton_attention.IS_INTERPRETED:
            sys.exit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    elif not torch.cuda.is_available():
        print("bench.gpu needs a CUDA device: torch.cuda.is_available() is False; nothing measured.")
        sys.exit(2)
    elif not triton_attention.IS_AVAILABLE or triton_attention.IS_INTERPRETED:
        print("bench.gpu needs triton compiled for CUDA (pip install triton; TRITON_INTERPRET unset).")
        sys.exit(2)
    repeats = 2 if args.smoke else 5 if args.quick else 15
    batches = [1, 2] if args.smoke else [1, 8, 64] if args.quick else [1, 8, 32, 64]
    lengths = [64, 128] if args.smoke else [1024, 8192] if args.quick else [1024, 4096, 16384, 32768]
    prefills = [(1024, 1024), (4096, 4096), (8192, 512)] + ([] if args.quick else [(16384, 16384)])
    if args.smoke:
        prefills = [(64, 64), (128, 32)]
    started = time.perf_counter()
    flush = torch.empty((1 << 20) if args.smoke else (256 << 20), dtype=torch.uint8, device=DEV)
    report: dict = {
        "meta": {
            "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (smoke test, interpreter)",
            "torch": torch.__version__,
            "triton": getattr(triton_attention.triton, "__version__", "?"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "copy": copy_bandwidth(repeats, (16 << 20) if args.smoke else 2 * GIB),
    }
    print(f"device copy: {report['copy']['gb_s']} GB/s (read + write)", flush=True)
    report["decode"] = decode(batches, lengths, repeats, flush)
    del flush
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    report["prefill"] = prefill(prefills, repeats)
    report["swap"] = swap(repeats, layers=1 if args.smoke else 32)
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu.md").write_text(to_markdown(report))
    plotted = plot(report, args.out / "gpu.png")
    print()
    print(to_markdown(report))
    print(
        f"wrote {args.out / 'gpu.json'}, {args.out / 'gpu.md'}"
        + (f", {args.out / 'gpu.png'}" if plotted else "")
    )


if __name__ == "__main__":
    main()
