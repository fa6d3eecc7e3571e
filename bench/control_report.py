# ruff: noqa: E501  (report strings and table rows)
"""bench.control's results as findings and a markdown report."""

from __future__ import annotations

from bench.control_setup import SUFFIX_LEN, SYSTEM_LEN


def findings(r: dict) -> str:
    """The findings paragraphs, computed from this run's numbers."""
    lat, g, h = r["latency"], r["goals"], r["coordinator_handler"]
    p50 = {k: v["p50_ms"] for k, v in lat.items() if v.get("n")}
    floor, hmean = p50["coord_health"], h["Open"].get("mean_ms", float("nan"))
    c = r["redis_commands"]
    text = [
        f"Round trips: an open costs {g['redis_round_trips_per_open']:.2f} Redis commands (one EVALSHA "
        "open_sequence: the prefix match on every candidate node, placement.place ported to Lua, the tenant's "
        "quota and the page table in one script); a close costs "
        f"{c['close']['per_op_total']:.2f} (EVALSHA delete_sequence, tenant-checked in the script)."
        + (
            f" The baseline coordinator (git {r['baseline_git']}) in the same run: "
            f"{c['open_before']['per_op_total']:.2f} per open "
            f"({', '.join(f'{k} {v:g}' for k, v in c['open_before']['per_op_by_command'].items())})."
            if "open_before" in c
            else ""
        ),
        f"Latency: open p50 {p50['open']:.2f} ms is {g['open_p50_over_noop_rpc_p50']:.2f}x the no-op RPC p50 "
        f"({floor:.2f} ms): the 2x goal is {'met' if g['open_p50_met'] else 'not met'}. What the open waits for: "
        f"the client -> coordinator RPC (~{floor:.2f} ms, the Health.Check floor) + the Open handler "
        f"({hmean:.2f} ms mean) + the client's request encoding (1,152 token ids, built and serialized: p50 "
        f"{p50.get('client_open_request', float('nan')):.3f} ms); the node Open is sent after the page table is "
        "written and never waited for.",
    ]
    if "open_before" in p50:
        hb = p50["coord_health_before"]
        oa = (
            f" Open + first append {p50['open+append_before']:.2f} -> {p50['open+append']:.2f} ms."
            if "open+append_before" in p50
            else ""
        )
        text.append(
            f"Before / after, same rounds: the baseline coordinator (git {r['baseline_git']}) opens in "
            f"{p50['open_before']:.2f} ms p50 = {p50['open_before'] / hb:.2f}x its own no-op RPC ({hb:.2f} ms); "
            f"this code {p50['open']:.2f} ms = {p50['open'] / floor:.2f}x ({p50['open_before'] - p50['open']:+.2f} "
            f"ms saved per open).{oa} Lookup {p50['lookup_before']:.2f} -> {p50['lookup']:.2f} ms; close "
            f"{p50['close_before']:.2f} -> {p50['close']:.2f} ms. Both are replicas: neither serves the nodes' "
            "heartbeats or events."
        )
    prof = r.get("profile") or {}
    if "Open" in prof:
        shares = {b["what"]: b["share"] for b in prof["Open"]["breakdown"]}
        # the node Open is sent by Coordinator._send_open, or where the servicer holds it back
        # (NodeCalls.held: the with-block's exit, outside Coordinator.open)
        node = sum(v for k, v in shares.items() if "_send_open" in k or "__exit__@contextlib" in k)
        os_ = sum(v for k, v in shares.items() if "open_sequence" in k)
        keys = sum(v for k, v in shares.items() if "chain_keys" in k)
        rest = max(0.0, 1 - node - os_ - keys)
        text.append(
            f"Inside the Open handler (py-spy, wall clock): the open_sequence script {os_:.0%} (~{os_ * hmean:.2f} "
            f"ms; direct p50 {p50['open_sequence_script']:.2f} ms), chain_keys {keys:.0%}, sending the node Open "
            f"{node:.0%} (~{node * hmean:.2f} ms), everything else (request decoding, NewSequence, node cache, "
            f"servicer) {rest:.0%} (~{rest * hmean:.2f} ms)."
        )
    ms = c.get("match_script_server_us", {})
    if "match_args_script" in p50:
        text.append(
            f"Keys as one packed argument (split in Lua with string.sub) vs 71 arguments: match_prefix client p50 "
            f"{p50['match_prefix_script']:.3f} ms vs {p50['match_args_script']:.3f} ms"
            + (
                f", server time p50 {ms['evalsha:match_prefix']['p50']:g} us vs {ms['evalsha:match_args']['p50']:g} us"
                if "evalsha:match_args" in ms and "evalsha:match_prefix" in ms
                else ""
            )
            + f". root_key per call, now cached per tenant: p50 {p50['root_key'] * 1e3:.1f} us; chain_keys over "
            f"71 blocks (joined): {p50['chain_keys_71_blocks'] * 1e3:.1f} us."
        )
    lower = floor + p50["redis_ping"]
    text.append(
        f"Floor of this design: one client RPC + one Redis round trip with zero work is {floor:.2f} + "
        f"{p50['redis_ping']:.2f} = {lower:.2f} ms = {lower / floor:.2f}x the no-op RPC; lookup (one RPC, one "
        f"Redis round trip, no writes) is {p50['lookup'] / floor:.2f}x ({p50['lookup']:.2f} ms)."
    )
    if "open+append" in p50:
        text.append(
            f"What a worker waits for before its first attention, open + first append of the 128 new tokens' "
            f"KV: p50 {p50['open+append']:.2f} ms. The append goes straight to the node and, when it overtakes "
            "the node Open, waits there for it (grace, condition variable) instead of failing NOT_FOUND."
        )
    return "\n\n".join(text)


def render(r: dict) -> str:
    lat = r["latency"]

    def row(label: str, key: str, note: str = "") -> str:
        x = lat.get(key)
        if not x or not x.get("n"):
            return f"| {label} | - | - | - | {note} |"
        return f"| {label} | {x['p50_ms']:.3f} | {x['p99_ms']:.3f} | {x['n']} | {note} |"

    g = r["goals"]
    c = r["redis_commands"]
    h = r["coordinator_handler"]
    bg = r.get("baseline_git", "")
    lines = [
        "# Control-plane latency (bench/control.py, issue 4)",
        "",
        f"Local cluster: redis-server {r['versions']['redis-server']} + coordinator + 2 nodes, each its own "
        "process; the measured coordinators (this code and the baseline) are replicas on the same Redis, "
        f"the nodes beat and report events to the cluster's own coordinator; all on one host ({r['host']['cpus']} CPUs, shared; loadavg before {r['loadavg_before'][0]:.2f}, "
        f"after {r['loadavg_after'][0]:.2f}). Spec {r['spec']}. Workload W2 ({r['workload']['source']}): "
        f"prompts of {SYSTEM_LEN} + {SUFFIX_LEN} tokens; every measured open hit "
        f"{', '.join(f'{k} tokens x{v}' for k, v in r['workload']['cached_tokens_per_open'].items())}. "
        f"{r['rounds']} interleaved rounds (shuffled order per round), one client thread. "
        f"Runtime {r['runtime_s']:.0f} s. grpcio {r['versions']['grpcio']}, redis-py {r['versions']['redis-py']} "
        f"(hiredis {r['versions'].get('hiredis', '-')}), Python {r['versions']['python']}, git "
        f"{r['versions']['pagedkv_git']}"
        + (f"; baseline coordinator: git {bg}, same redis-server and nodes, same rounds." if bg else "."),
        "",
        "| call (from the bench process) | p50 ms | p99 ms | n | what it is |",
        "|---|---:|---:|---:|---|",
        row(
            "**open** (CacheClient.open)",
            "open",
            "RPC to coordinator: keys + open_sequence (1 Redis round trip); the worker sends the node Open it answers (signed), not awaited",
        ),
        row(
            "open, the coordinator sending the node Open (`worker_opens=False`)",
            "open_coord",
            "the same, but the node Open sent by the coordinator after the script",
        ),
        row(
            "**close** (Sequence.close)",
            "close",
            "RPC to coordinator: delete_sequence (tenant-checked); node Free sent, not awaited",
        ),
        row(
            "**open + first append** (128 new tokens' KV)",
            "open+append",
            "what a worker waits for before its first attention",
        ),
        row("lookup (CacheClient.lookup)", "lookup", "RPC to coordinator: keys + match_prefix, no node hop"),
        row("**no-op RPC**: coordinator Health.Check", "coord_health", "same server, process and channel"),
    ]
    if bg:
        lines += [
            row(
                f"open, baseline coordinator (git {bg})",
                "open_before",
                f"{c['open_before']['per_op_total']:.0f} Redis round trip(s); that revision's coordinator, requests built the previous way"
                if "open_before" in c
                else "",
            ),
            row(f"open + first append, baseline coordinator (git {bg})", "open+append_before", ""),
            row(f"close, baseline coordinator (git {bg})", "close_before", ""),
            row(f"lookup, baseline coordinator (git {bg})", "lookup_before", ""),
            row(f"no-op RPC, baseline coordinator (git {bg})", "coord_health_before", "its own Health.Check"),
        ]
    lines += [
        row("**bare Redis PING** (redis-py)", "redis_ping", "same redis-server"),
        row(
            "open_sequence script (RedisStore)",
            "open_sequence_script",
            "71 keys, 64 hit, 2 candidates: match + place + write",
        ),
        row("delete_sequence script", "delete_sequence_script", ""),
        row(
            "match_prefix script, keys packed", "match_prefix_script", "71 keys in one argument, split in Lua"
        ),
        row("match_prefix script, 71 key arguments", "match_args_script", "the previous form; same reply"),
        row("chain_keys (71 blocks, joined)", "chain_keys_71_blocks", "the keys the coordinator hashes"),
        row("root_key (per call before, cached now)", "root_key", "one SHA-256 of the salt"),
        row("node Open RPC, direct", "node_open_direct", "the hop open sends, off its path (1,024 cached)"),
        row("node Free RPC, direct", "node_free_direct", "the hop close sends, off its path"),
        row("node Health.Check", "node_health", "no-op RPC floor of the node"),
        row(
            "client: CoordOpenRequest built + serialized",
            "client_open_request",
            "1,152 token ids, from a list",
        ),
        row(
            "client: the same, the previous way",
            "client_open_request_before",
            "int() per id into a new list, then the message (before ce69823)",
        ),
        row("coordinator: request parsed + key ids sliced", "server_parse_slice", "before chain_keys"),
        "",
        f"Coordinator-side handler time over the same rounds (its `pagedkv_coordinator_rpc_latency_seconds`): "
        f"Open mean {h['Open'].get('mean_ms', float('nan')):.3f} ms, Close mean {h['Close'].get('mean_ms', float('nan')):.3f} ms, "
        f"Lookup mean {h['Lookup'].get('mean_ms', float('nan')):.3f} ms.",
        "",
        f"Sequential open+close: {r['throughput']['sequential_open_close_per_s']:.0f}/s (1 thread)"
        + (
            f"; {r['throughput']['concurrent']['open_close_per_s']:.0f}/s with {r['throughput']['concurrent']['threads']} client threads."
            if r["throughput"]["concurrent"]
            else "."
        ),
        "",
        "## Redis commands per operation (counted: SLOWLOG at 0 us, every command logged)",
        "",
        "| op | commands / op | by command (per op) | server us / call (p50) | commandstats cross-check |",
        "|---|---:|---|---|---:|",
    ]
    for phase in ("open", "close", "open_before", "close_before"):
        if phase not in c:
            continue
        x = c[phase]
        by = ", ".join(f"{k} {v:g}" for k, v in x["per_op_by_command"].items())
        us = ", ".join(
            f"{k} {v['p50']:g}" for k, v in x["server_us_per_call"].items() if k in x["per_op_by_command"]
        )
        label = phase.replace("_before", f" (baseline, git {bg})")
        lines.append(
            f"| {label} | {x['per_op_total']:.2f} | {by} | {us} | {x['commandstats_per_op_minus_background']:.2f} |"
        )
    lines += [
        "",
        "Server-side time of the scripts (SLOWLOG, us, 100 calls each): "
        + ", ".join(
            f"{k} p50 {v['p50']:g} / p99 {v['p99']:g}" for k, v in c.get("match_script_server_us", {}).items()
        )
        + ".",
        "",
        "Commands run inside those scripts (not round trips; Redis is blocked meanwhile), per op: "
        + "; ".join(
            f"{ph}: " + ", ".join(f"{k} {v:g}" for k, v in c[ph]["commands_inside_scripts_per_op"].items())
            for ph in ("open", "close", "open_before")
            if ph in c
        )
        + ".",
        "",
        f"Background commands in the windows (heartbeats, reaper, node events), excluded: "
        f"open {c['open']['background_in_window']}, close {c['close']['background_in_window']}.",
        "",
        "## Goals",
        "",
        f"- Redis round trips per open <= 2: **{'met' if g['redis_round_trips_met'] else 'NOT met'}** "
        f"({g['redis_round_trips_per_open']:.2f}).",
        f"- open p50 <= 2x the no-op RPC p50: **{'met' if g['open_p50_met'] else 'NOT met'}** "
        f"(open p50 {lat['open']['p50_ms']:.3f} ms = {g['open_p50_over_noop_rpc_p50']:.2f}x the Health.Check p50 "
        f"{lat['coord_health']['p50_ms']:.3f} ms).",
        "",
    ]
    if bg:
        lines += [
            f"## Before / after, measured in the same rounds (before: coordinator at git {bg}; after: this code)",
            "",
            "| p50 ms | before | after | no-op RPC before / after | ratio before / after |",
            "|---|---:|---:|---:|---:|",
        ]
        hb, ha = lat["coord_health_before"]["p50_ms"], lat["coord_health"]["p50_ms"]
        for key in ("open", "open+append", "close", "lookup"):
            if f"{key}_before" not in lat:
                continue
            b_, a_ = lat[f"{key}_before"]["p50_ms"], lat[key]["p50_ms"]
            lines.append(
                f"| {key} | {b_:.3f} | {a_:.3f} | {hb:.3f} / {ha:.3f} | {b_ / hb:.2f}x / {a_ / ha:.2f}x |"
            )
        ob = c.get("open_before", {}).get("per_op_total", float("nan"))
        lines += [
            f"| Redis round trips per open | {ob:.2f} | {g['redis_round_trips_per_open']:.2f} | | |",
            "",
        ]
    prof = r.get("profile") or {}
    if "Open" in prof:
        lines += [
            f"## Where the coordinator's Open handler spends its wall time ({prof['tool']}, "
            f"{prof['open_close_ops']} open+close)",
            "",
            "| Open handler was in | share |",
            "|---|---:|",
        ]
        lines += [f"| {b['what']} | {b['share']:.1%} |" for b in prof["Open"]["breakdown"][:10]]
        lines += ["", "| Close handler was in | share |", "|---|---:|"]
        lines += [f"| {b['what']} | {b['share']:.1%} |" for b in prof["Close"]["breakdown"][:8]]
        lines.append("")
    elif prof:
        lines += [f"Profile: {prof.get('error')}", ""]
    if r.get("findings"):
        lines += ["## Findings", "", r["findings"], ""]
    return "\n".join(lines)
