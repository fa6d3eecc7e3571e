"""bench.rpc's results as a plot and a markdown report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import plots
from bench.rpc import BATCHES, IDLE_S, SHORT_LEN


def plot(r: dict[str, Any], path: Path) -> bool:
    """Left: each channel path's transport per attend (call - handler) in gRPC Pings:
    back to back, and for the calls that follow a ~32 ms wait (batch 32; the control
    with the idle first) also against the Ping timed in those conditions; the 1.3x goal.
    Right: transfer GB/s per path against the loopback socket. False without matplotlib."""
    plt = plots.pyplot()
    if plt is None:
        return False
    lat, ping = r["latency"], r["latency"]["ping"]["p50_ms"]
    idle_ping = lat.get("ping_idle", {}).get("p50_ms")
    names = {"tcp": "TCP", "shm": "shm"}
    groups: list[tuple[str, float, bool]] = []  # label, call - handler ms, follows a long wait
    for b in BATCHES:
        for p in ("tcp", "shm"):
            if f"attend_paths_b{b}" in lat:
                ms = lat[f"attend_paths_b{b}"][p]["call_minus_handler"]["p50_ms"]
                groups.append((f"{names[p]}\nb{b}", ms, b == max(BATCHES)))
    controls = (("attend_short_warm", "L=64", False), ("attend_short_idle", "L=64 idle\nfirst", True))
    for key, label, waits in controls:
        for p in ("tcp", "shm"):
            if key in lat:
                ms = lat[key][p]["call_minus_handler"]["p50_ms"]
                groups.append((f"{names[p]} b{max(BATCHES)}\n{label}", ms, waits))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = list(range(len(groups)))
    bars = left.bar(
        [x - 0.2 for x in xs],
        [g[1] / ping for g in groups],
        0.4,
        label=f"/ Ping back to back ({ping:.2f} ms)",
    )
    left.bar_label(bars, labels=[f"{g[1] / ping:.2f}" for g in groups], fontsize=7)
    if idle_ping is not None:
        waited = [(x, g) for x, g in zip(xs, groups, strict=True) if g[2]]
        bars = left.bar(
            [x + 0.2 for x, _ in waited],
            [g[1] / idle_ping for _, g in waited],
            0.4,
            label=f"/ Ping idle 32 ms first ({idle_ping:.2f} ms): same conditions",
        )
        left.bar_label(bars, labels=[f"{g[1] / idle_ping:.2f}" for _, g in waited], fontsize=7)
    left.axhline(1.3, color="k", linestyle="--", linewidth=1, label="goal 1.3x")
    left.set_xticks(xs, [g[0] for g in groups], fontsize=7)
    left.set_ylim(0, 1.3 * max(g[1] / ping for g in groups))
    left.set_ylabel("attend call - node handler, p50 / gRPC Ping p50")
    left.set_title(
        f"Attend transport, L={r['context_len']} (control: L=64), one layer (lower is better)", fontsize=10
    )
    left.legend(fontsize=7, loc="upper left")
    if r["transfer"]:
        paths = list(r["transfer"])
        series = [
            ("upload_gbps", "upload"),
            ("download_gbps", "download, fresh tensors"),
            ("download_into_gbps", "download into the caller's (out=)"),
            ("loopback_socket_gbps", "loopback socket"),
        ]
        width = 0.8 / len(series)
        for i, (key, label) in enumerate(series):
            at = [j + (i - (len(series) - 1) / 2) * width for j in range(len(paths))]
            right.bar(at, [r["transfer"][p].get(key, 0.0) for p in paths], width, label=label)
        right.axhline(0.8, color="k", linestyle="--", linewidth=1, label="goal 0.8 GB/s")
        short = [p.split(" (")[0].replace("bulk ", "").replace("same-host ", "") for p in paths]
        short = [p.replace(", ", "\n") for p in short]
        right.set_xticks(range(len(paths)), short, fontsize=8)
        right.set_ylabel("GB/s (median)")
        right.set_title("256 MiB KV transfer (higher is better)", fontsize=10)
        right.legend(fontsize=7)
    else:
        right.set_axis_off()
    plots.save(fig, path)
    return True


def render(r: dict[str, Any]) -> str:
    lat = r["latency"]
    lines = [
        "# RPC overhead and KV transfer (bench/rpc.py)",
        "",
        f"Spec {r['spec']}, {r['num_q_heads']} query heads, L = {r['context_len']} tokens per sequence, "
        f"one layer; node in a child process on the same host ({r['host']['cpus']} CPUs, "
        f"{r['host']['machine']}, torch {r['host']['torch']}). Medians of one run.",
        "",
        "| call | p50 ms | p99 ms | engine p50 ms | overhead p50 ms | overhead / ping p50 |",
        "|---|---:|---:|---:|---:|---:|",
        f"| Ping (no-op floor) | {lat['ping']['p50_ms']:.3f} | {lat['ping']['p99_ms']:.3f} | - | - | - |",
    ]
    ping = lat["ping"]["p50_ms"]
    for b in BATCHES:
        a = lat[f"attend_b{b}"]
        lines.append(
            f"| Attend rpc (gRPC) batch {b} | {a['rpc']['p50_ms']:.3f} | {a['rpc']['p99_ms']:.3f} | "
            f"{a['engine']['p50_ms']:.3f} | {a['overhead_p50_ms']:.3f} | {a['overhead_over_ping_p50']:.2f}x |"
        )
    bp = lat.get("bulk_ping")
    if bp is not None:
        lines += [
            "",
            "The same calls over the node's bulk TCP channel (ATTEND op; what the client uses when the node "
            "advertises it):",
            "",
            "| call | p50 ms | p99 ms | engine p50 ms | overhead p50 ms | overhead / gRPC Ping p50 "
            "| overhead / channel PING p50 |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| channel PING (its no-op floor) | {bp['p50_ms']:.3f} | {bp['p99_ms']:.3f} | - | - | "
            f"{bp['p50_ms'] / ping:.2f}x (PING / Ping) | - |",
        ]
        tail = [
            "",
            "Where a channel call's time goes (same run): the node's handler (body received -> engine "
            "-> reply handed to the socket, the Attend latency metric) against the client's wall, means; "
            "the engine paced by the channel's overhead (idle that long before each call); and the same "
            "request refused by the node's validation (layer out of range: q sent, parsed, error "
            "reply; no engine), the channel's floor for a request of that size.",
            "",
            "| batch | call mean ms | node handler mean ms | call - handler ms | engine back to back p50 ms "
            "| engine paced p50 ms | refused request p50 ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for b in BATCHES:
            a = lat[f"attend_bulk_b{b}"]
            c, e = a["call"], a["engine"]
            lines.append(
                f"| Attend over the channel batch {b} | {c['p50_ms']:.3f} | {c['p99_ms']:.3f} "
                f"| {e['p50_ms']:.3f} | {a['overhead_p50_ms']:.3f} | {a['overhead_over_ping_p50']:.2f}x "
                f"| {a['overhead_over_bulk_ping_p50']:.2f}x |"
            )
            tail.append(
                f"| {b} | {a['call_mean_ms']:.3f} | {a['node_handler_mean_ms']:.3f} "
                f"| {a['call_mean_ms'] - a['node_handler_mean_ms']:.3f} | {e['p50_ms']:.3f} "
                f"| {a['engine_paced']['p50_ms']:.3f} | {a['refused_call']['p50_ms']:.3f} |"
            )
        lines += tail
    sp = lat.get("shm_ping")
    if sp is not None and f"attend_paths_b{BATCHES[0]}" in lat:
        lines += [
            "",
            "Same-host shared memory (ATTEND_SHM: q/k/v and out/lse through a memfd region both processes "
            "map, a 32-byte header over a Unix socket; what a client on the node's host uses) against the "
            "channel's TCP socket (what a client on another host uses), alternating call by call in this "
            "run. Overhead = call p50 - in-process engine p50 (as above); call - handler = per call, the "
            "client's wall minus the node's own handler time for that call (parse + engine), p50: the "
            "transport alone, without the engine's run-to-run spread.",
            "",
            "| path | batch | call p50 ms | call p99 ms | overhead p50 ms | overhead / gRPC Ping | "
            "call - handler p50 ms | call - handler / gRPC Ping | refused request p50 ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| same-host PING (Unix socket, its floor) | - | {sp['p50_ms']:.3f} | {sp['p99_ms']:.3f} | - | "
            f"{sp['p50_ms'] / ping:.2f}x (PING / Ping) | - | - | - |",
        ]
        for b in BATCHES:
            for name, key in (("TCP channel", "tcp"), ("same-host shm", "shm")):
                a = lat[f"attend_paths_b{b}"][key]
                c, n = a["call"], a["call_minus_handler"]
                lines.append(
                    f"| {name} | {b} | {c['p50_ms']:.3f} | {c['p99_ms']:.3f} | {a['overhead_p50_ms']:.3f} | "
                    f"{a['overhead_over_ping_p50']:.2f}x | {n['p50_ms']:.3f} | "
                    f"{a['call_minus_handler_over_ping_p50']:.2f}x | {a['refused_call']['p50_ms']:.3f} |"
                )
    if "attend_short_warm" in lat and "ping_idle" in lat:
        b = max(BATCHES)
        idle_ping = lat["ping_idle"]["p50_ms"]
        lines += [
            "",
            f"Batch {b} against the floor in the same conditions (same run). A call of batch {b} at "
            f"L = {r['context_len']} waits ~{IDLE_S * 1e3:.0f} ms for its engine, and on this host any "
            f"process that waited that long runs its next few hundred microseconds slower (cold caches, "
            f"an idle vCPU to wake): the gRPC Ping with both processes idle {IDLE_S * 1e3:.0f} ms before "
            f"each call takes {idle_ping:.3f} ms p50 against {ping:.3f} back to back. The control: the "
            f"same request and reply sizes (q, out, lse of batch {b}) over sequences of L = {SHORT_LEN} "
            f"(an engine ~60x shorter), back to back and with the same idle first. Each row alternates "
            f"TCP and shared memory call by call; call - handler as above.",
            "",
            f"| path | sequences | before each call | call - handler p50 ms | / Ping back to back "
            f"({ping:.3f} ms) | / Ping idle first ({idle_ping:.3f} ms) | refused request p50 ms |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        rows = (
            (f"L = {r['context_len']}", f"its ~{IDLE_S * 1e3:.0f} ms engine", lat.get(f"attend_paths_b{b}")),
            (f"L = {SHORT_LEN}", "nothing (back to back)", lat["attend_short_warm"]),
            (f"L = {SHORT_LEN}", f"idle {IDLE_S * 1e3:.0f} ms", lat["attend_short_idle"]),
        )
        for seqs, before, paths in rows:
            if paths is None:
                continue
            for name, key in (("TCP channel", "tcp"), ("same-host shm", "shm")):
                a = paths[key]
                n = a["call_minus_handler"]["p50_ms"]
                lines.append(
                    f"| {name} | {seqs} | {before} | {n:.3f} | {n / ping:.2f}x | {n / idle_ping:.2f}x "
                    f"| {a['refused_call']['p50_ms']:.3f} |"
                )
    lines += [
        "",
        "Overhead = call p50 - in-process engine p50, timed back to back (goal: <= 1.3 x the gRPC Ping p50).",
        "",
        "Where the overhead goes (same run):",
        "",
        "| batch | engine back to back p50 ms | engine paced p50 ms | engine in a bare gRPC handler p50 ms "
        "| bare gRPC, engine handler: RPC - handler ms (/ ping) | bare gRPC, sleeping handler: RPC - handler "
        "ms (/ ping) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for b in BATCHES:
        a = lat[f"attend_b{b}"]
        fl, h = a.get("bare_grpc_floor"), a.get("engine_in_bare_grpc_handler")
        if fl is None or h is None:
            continue
        lines.append(
            f"| {b} | {a['engine']['p50_ms']:.3f} | {a['engine_paced']['p50_ms']:.3f} | "
            f"{h['blocked_p50_ms']:.3f} | {h['overhead_p50_ms']:.3f} ({h['overhead_p50_ms'] / ping:.2f}x) | "
            f"{fl['overhead_p50_ms']:.3f} ({fl['overhead_p50_ms'] / ping:.2f}x) |"
        )
    lines += [
        "",
        "Engine paced: the same call with the RPC's non-engine time spent idle (time.sleep) before each",
        "call. Bare gRPC: a gRPC-Python server with no pagedkv servicer and no protobuf, payloads the size",
        "of an attend's, whose handler runs the same engine call (or blocks, GIL released, for the engine",
        "p50); RPC - handler is the p50 over calls of (RPC time - that handler's own time).",
    ]
    return "\n".join(lines + render_transfer(r))


def render_transfer(r: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "| path | upload GB/s (append) | download GB/s (read_kv) | download GB/s (read_kv into the "
        "caller's tensors) | loopback socket GB/s (same loop) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t in r["transfer"].items():
        into = t.get("download_into_gbps")
        lines.append(
            f"| {name} | {t['upload_gbps']:.2f} | {t['download_gbps']:.2f} | "
            f"{'-' if into is None else f'{into:.2f}'} | {t['loopback_socket_gbps']:.2f} |"
        )
    lines += [
        "",
        f"256 MiB per transfer, end to end through the client API (tensors in / tensors out: fresh ones, "
        f"or with `out=` the caller's, reused), median of "
        f"{next(iter(r['transfer'].values()), {}).get('repeats', 0)}. Goal: >= 0.8 GB/s both ways.",
        f"Runtime {r['runtime_s']:.0f} s.",
        "",
    ]
    return lines
