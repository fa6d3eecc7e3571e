"""bench.ttft's results as a plot and a markdown report."""

from __future__ import annotations

from pathlib import Path

from bench import plots
from bench.ttft import GATHER, SIDE_VARIANTS, TRANSPORTS

PLOTTED = [  # (ttft_ms key, label)
    ("cached/process", "cached prefix,\nnode process"),
    ("cached/in-process", "cached prefix,\nnode in-process"),
    ("cached/process, gRPC only", "cached prefix,\ngRPC only"),
    (f"cached/{GATHER}", "cached prefix,\nK/V read back"),
    ("local_floor", "floor: suffix on a\nwarm DynamicCache"),
    ("local", "full recompute\n(DynamicCache)"),
]


def plot(r: dict, path: Path) -> bool:
    """TTFT / local recompute per model and path, with the goal line; False without matplotlib."""
    plt = plots.pyplot()
    if plt is None:
        return False
    models = list(r["models"].items())
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(models)
    for i, (name, m) in enumerate(models):
        ys = [m["ttft_ms"][key] / m["ttft_ms"]["local"] for key, _ in PLOTTED]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(PLOTTED))]
        shape = m["model"]
        label = f"{name}: {shape['num_layers']} layers, hidden {shape['hidden_size']}"
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=7)
    ax.axhline(r["goal_ratio"], color="k", linestyle="--", linewidth=1, label=f"goal {r['goal_ratio']}x")
    ax.set_xticks(range(len(PLOTTED)), [label for _, label in PLOTTED], fontsize=8)
    ax.set_ylabel("TTFT / full recompute (medians)")
    ax.set_title(
        f"Time to first token, {r['prefix_tokens']}-token cached prefix + {r['suffix_tokens']} new tokens "
        "(lower is better)"
    )
    ax.legend(fontsize=8)
    plots.save(fig, path)
    return True


def render(r: dict) -> str:
    goal = r["goal_ratio"]
    lines = [
        "# Time to first token: cached prefix vs recompute",
        "",
        f"Random Llamas, fp32, CPU ({r['machine']['cpu_threads']} threads, a shared VM; load average "
        f"{r['machine'].get('load_average_start', ['?'])[0]} at the start, "
        f"{r['machine'].get('load_average_end', ['?'])[0]} at the end; "
        f"{r['machine'].get('omp_wait', '?')} for worker and nodes), block size "
        f"{r['block_size']}; {r['prefix_tokens']}-token cached prefix + {r['suffix_tokens']} new tokens; "
        f"medians of {r['repeats']} repeats, variants interleaved. Two node placements on localhost, "
        "control calls over gRPC and the per-layer data calls (AttendPrefillBatch, Attend) over the "
        "node's bulk channel (its same-host shared-memory path where the node offers one, else TCP), "
        "as the client does by default: **process** = the node in its own "
        "process (`pagedkv node`), as deployed; **in-process** = the node's server inside the worker's "
        "process (shares its GIL), measured after everything else with its own local recompute "
        "beside it: its handler threads' torch thread pools make libgomp throttle the worker's own, "
        "which slowed the worker's compute in every variant measured beside it (earlier runs of this "
        "benchmark did that). **process, gRPC only** = the node process with every call on the "
        "gRPC rpcs (the fallback), and **process, gathered KV** = the node process in the cache's "
        "second mode (the prefix's K/V read back, attention in the worker, the suffix's K/V appended "
        "after the forward), and **process, compute thread on** = a second node process whose engine "
        "calls all run on one thread of its own (`--compute-thread on`; the default is off), all "
        "measured in one loop with the local recompute and the floor.",
        "",
    ]
    for name, m in r["models"].items():
        t, ratio = m["ttft_ms"], m["ratio_cached_vs_local_recompute"]
        lines += [
            f"## {name} model: {m['model']}",
            "",
            "| path | TTFT (ms) | vs local recompute |",
            "|---|---:|---:|",
        ]
        for tr in ("process", *SIDE_VARIANTS):
            if f"cached/{tr}" in t:
                lines.append(f"| cached prefix, node {tr} | {t[f'cached/{tr}']:.1f} | {ratio[tr]:.2f}x |")
        lines.append(f"| full recompute, transformers DynamicCache | {t['local']:.1f} | 1.00x |")
        if "local_floor" in t:
            lines.append(
                "| floor: the suffix on a DynamicCache already holding the prefix (no node) "
                f"| {t['local_floor']:.1f} | {t['local_floor'] / t['local']:.2f}x |"
            )
        lines.append(
            f"| full recompute, node process | {t['node_full/process']:.1f} "
            f"| {t['node_full/process'] / t['local']:.2f}x |"
        )
        in_local = t["local/in-process phase"]
        lines += [
            f"| *later, the node in the worker's process:* cached prefix | {t['cached/in-process']:.1f} "
            f"| {ratio['in-process']:.2f}x |",
            f"| *later:* full recompute, DynamicCache, beside it | {in_local:.1f} | 1.00x |",
            f"| *later:* full recompute, node in-process | {t['node_full/in-process']:.1f} "
            f"| {t['node_full/in-process'] / in_local:.2f}x |",
        ]
        verdict = "; ".join(
            f"node {tr}: {'met' if ratio[tr] <= goal else 'NOT met'} ({ratio[tr]:.2f}x)" for tr in TRANSPORTS
        )
        lines += [
            "",
            f"Goal cached <= {goal}x of local recompute -> {verdict}. Prefix hit per call: "
            f"{sorted(set(m['cached_prefix_hit_tokens']))} tokens; first token equals recompute's: "
            f"{m['first_token_matches_recompute']}; blocks in use after the run: "
            f"{m['node_used_blocks_after']}; data calls over the bulk channel (of which same-host "
            f"shared memory): "
            + ", ".join(
                f"{t} {n} ({m.get('of_which_same_host_shared_memory', {}).get(t, 0)})"
                for t, n in m["data_calls_over_bulk_channel"].items()
            )
            + ".",
            "",
            "Where the cached TTFT goes (in-process node, separate untimed-for-the-table pass, median ms; "
            "the data calls over the bulk channel, and over gRPC only; the worker's own compute runs "
            "throttled there, as in the in-process rows above):",
            "",
            "| phase | bulk channel (used) | gRPC only |",
            "|---|---:|---:|",
        ]
        grpc_phases = m.get("cached_phases_grpc_only_ms", {})
        lines += [
            f"| {k} | {v:.1f} | {grpc_phases[k]:.1f} |" if k in grpc_phases else f"| {k} | {v:.1f} | - |"
            for k, v in m["cached_phases_ms"].items()
        ]
        lines.append("")
        if m["batch_8_ttft_ms_node_process"]:
            b8 = m["batch_8_ttft_ms_node_process"]
            lines += [
                "Batch of 8 cached prompts (same prefix, 8 different suffixes), node process, TTFT ms:",
                "",
                "| AttendPrefillBatch (1 call per layer, bulk channel, used) | AttendPrefill per row "
                "(8 gRPC rpcs per layer) "
                "| local recompute | batched / local |",
                "|---:|---:|---:|---:|",
                f"| {b8['batched rpc']:.1f} | {b8['per-row rpcs']:.1f} | {b8['local']:.1f} "
                f"| {b8['batched rpc'] / b8['local']:.2f}x |",
                "",
                f"Each variant gets suffixes of its own ({int(b8['fed_tokens_per_row'])} tokens fed per "
                "row, checked), in alternating order; the worker sends one AttendPrefillBatch per layer "
                "(over the bulk channel; AttendPrefill has no channel op, so the per-row variant is gRPC).",
                "",
            ]
        if m["decode"]:
            lines += [
                f"Decode ({r['decode_steps']} steps after the prompt), tokens/s:",
                "",
                "| batch | node process | local DynamicCache | process / local |",
                "|---:|---:|---:|---:|",
            ]
            for b, d in m["decode"].items():
                proc, local = (d[f"{k}_tokens_per_s"] for k in ("process", "local"))
                lines.append(f"| {b.split('_')[1]} | {proc:.0f} | {local:.0f} | {proc / local:.2f}x |")
            lines.append("")
    lines += [
        "Reading it: the cached path runs the model on the suffix only: one Open rpc before the first "
        "layer (no Lookup), then per layer one AttendPrefillBatch call (all rows) over the node's bulk "
        "channel that appends the suffix's K/V and attends. Its floor is the suffix's own compute "
        "(model + attention over the whole prompt), which a local recompute also pays; the rest is one "
        "round trip per layer carrying the suffix's q/k/v out and the output back (gRPC-Python's "
        "per-call cost is what the channel removes; the gRPC-only column shows it). Decode pays that "
        "round trip per layer per step: at batch 1 it dominates a model this small; one Attend call "
        "per layer serves the whole batch, so batches amortise it. What it buys: the worker holds no "
        "K/V, prefixes are shared across workers, and K/V bytes never cross the network.",
        "",
        "This VM's 2 cores are shared with other jobs: a busy neighbour slows the compute-bound local "
        "recompute (2-thread matmuls) more than the latency-bound cached path, so ratios move between "
        "runs; the raw per-repeat times are in ttft.json.",
        "",
    ]
    return "\n".join(lines)
