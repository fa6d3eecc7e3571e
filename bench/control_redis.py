"""What bench.control reads from Redis and the coordinator's metrics: the handler latency
histogram, the store's scripts by digest, commands per open counted from SLOWLOG."""

from __future__ import annotations

import hashlib
import statistics
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.control_setup import log
from pagedkv.coordinator import event_run_scripts, redis_scripts


def scrape_handler_hist(port: int) -> dict[str, dict[str, Any]]:
    """{method: {sum, count, buckets{le: cumulative}}} of the coordinator's RPC latency histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"sum": 0.0, "count": 0.0, "buckets": {}})
    for fam in text_string_to_metric_families(text):
        if fam.name != "pagedkv_coordinator_rpc_latency_seconds":
            continue
        for s in fam.samples:
            m = s.labels.get("method", "")
            if s.name.endswith("_sum"):
                out[m]["sum"] = s.value
            elif s.name.endswith("_count"):
                out[m]["count"] = s.value
            elif s.name.endswith("_bucket"):
                out[m]["buckets"][s.labels["le"]] = s.value
    return dict(out)


def hist_delta(a: dict, b: dict, method: str) -> dict[str, float]:
    x, y = a.get(method), b.get(method)
    if not y:
        return {}
    n = y["count"] - (x["count"] if x else 0)
    s = y["sum"] - (x["sum"] if x else 0.0)
    res = {"count": n, "mean_ms": s / n * 1e3 if n else float("nan")}
    # bucket-resolution p50/p99 (upper bound of the bucket holding the quantile)
    buckets = sorted(
        ((float(le), c - (x["buckets"].get(le, 0) if x else 0)) for le, c in y["buckets"].items())
    )
    for q in (0.5, 0.99):
        for le, c in buckets:
            if c >= q * n:
                res[f"p{int(q * 100)}_le_ms"] = le * 1e3
                break
    return res


def script_names() -> dict[str, str]:
    """EVALSHA digest -> RedisStore script name."""
    names = {}
    for module in (redis_scripts, event_run_scripts):
        for attr in dir(module):
            val = getattr(module, attr)
            if attr.isupper() and isinstance(val, str) and "redis.call" in val:
                names[hashlib.sha1(val.encode()).hexdigest()] = attr.strip("_").lower()
    return names


# The previous _MATCH_PREFIX: the same per-node SMISMEMBER, but every key its own
# argument (ARGV: P, key1, key2, ...; 72 arguments for a W2 open, each encoded by
# redis-py) instead of one packed argument split in Lua. Same reply (checked).
MATCH_ARGS = """
local P = ARGV[1]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', P .. 'nodes')) do
  if redis.call('EXISTS', P .. 'alive:' .. id) == 1 then
    local n, first = 0, 2
    while first <= #ARGV do
      local last = math.min(first + 3999, #ARGV)
      local held = redis.call('SMISMEMBER', P .. 'nkeys:' .. id, unpack(ARGV, first, last))
      local i = 1
      while i <= #held and held[i] == 1 do i = i + 1 end
      n = n + i - 1
      if i <= #held then break end
      first = last + 1
    end
    out[#out + 1] = id; out[#out + 1] = n
  end
end
return out
"""

# nodes' beats and events (unnumbered, and numbered runs), the reaper
BACKGROUND = {"heartbeat", "list_nodes", "apply_events", "apply_event_runs", "applied_seq", "register"}


def commandstats(r: redis.Redis) -> dict[str, int]:
    info = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def slowlog_entries(r: redis.Redis, me: str, shas: dict[str, str]) -> list[dict[str, Any]]:
    raw = r.execute_command("SLOWLOG GET -1")
    out = []
    for e in raw:
        # redis-py may parse the reply into dicts; handle both shapes
        if isinstance(e, dict):
            args, dur, addr = e.get("command", b""), e.get("duration", 0), e.get("client_address", b"")
            args = args.split() if isinstance(args, bytes | str) else args
        else:
            args, dur, addr = e[3], e[2], e[4]
        args = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args[:2]]
        addr = addr.decode() if isinstance(addr, bytes) else str(addr)
        if addr == me:  # the bench's own INFO / SLOWLOG / CONFIG
            continue
        cmd = args[0].lower() if args else "?"
        name = cmd
        if cmd == "evalsha" and len(args) > 1:
            name = "evalsha:" + shas.get(args[1], args[1][:8])
        elif cmd == "eval":
            name = "eval:" + shas.get(hashlib.sha1(args[1].encode()).hexdigest(), "?")
        # commands a Lua script runs come from the fake client "?:0": not round trips
        out.append({"name": name, "us": int(dur), "addr": addr, "in_script": addr.startswith("?")})
    return out


def count_commands(
    r: redis.Redis,
    me_addr: str,
    count_ops: int,
    openers: dict[str, Callable[[], Any]],
    scripts: list[Callable[[list[int]], object]],
    prompts: list[list[int]],
) -> dict[str, Any]:
    """Redis commands per open and per close, exactly: SLOWLOG at a 0 us threshold logs every
    command. openers: phase name ("open", "open_before") -> one open (its sequence is closed
    in the matching "close" phase); scripts: called on 100 prompts for their server time."""
    log(f"counting Redis commands over {count_ops} opens, then {count_ops} closes ...")
    # MATCH_ARGS is byte for byte the baseline's match_prefix script (same digest)
    shas = {**script_names(), hashlib.sha1(MATCH_ARGS.encode()).hexdigest(): "match_args"}
    old_cfg = {k: r.config_get(k)[k] for k in ("slowlog-log-slower-than", "slowlog-max-len")}
    r.config_set("slowlog-max-len", 100000)
    counts: dict[str, Any] = {}
    seqs: dict[str, list] = defaultdict(list)
    phases = [p for name in openers for p in (name, name.replace("open", "close"))]
    try:
        r.config_set("slowlog-log-slower-than", 0)
        for phase in phases:
            r.slowlog_reset()
            cs0 = commandstats(r)
            t0 = time.monotonic()
            if phase in openers:
                for _ in range(count_ops):
                    seqs[phase].append(openers[phase]())
            else:
                for s in seqs[phase.replace("close", "open")]:
                    s.close()
            dt = time.monotonic() - t0
            cs1 = commandstats(r)
            entries = slowlog_entries(r, me_addr, shas)
            by = Counter(e["name"] for e in entries if not e["in_script"])
            in_script = Counter(e["name"] for e in entries if e["in_script"])
            us = defaultdict(list)
            for e in entries:
                if not e["in_script"]:
                    us[e["name"]].append(e["us"])
            fg = {k: v for k, v in by.items() if k.split(":")[-1] not in BACKGROUND}
            bg = {k: v for k, v in by.items() if k.split(":")[-1] in BACKGROUND}
            delta = {k: cs1.get(k, 0) - cs0.get(k, 0) for k in cs1}
            delta = {k: v for k, v in delta.items() if v}
            n = count_ops
            counts[phase] = {
                "ops": n,
                "window_s": dt,
                "per_op_total": sum(fg.values()) / n,
                "per_op_by_command": {k: v / n for k, v in sorted(fg.items())},
                "background_in_window": bg,
                "commands_inside_scripts_per_op": {k: v / n for k, v in sorted(in_script.items())},
                "server_us_per_call": {
                    k: {"p50": statistics.median(v), "max": max(v)} for k, v in us.items()
                },
                "commandstats_delta": delta,
                "commandstats_per_op_minus_background": (
                    sum(delta.values())
                    - sum(in_script.values())
                    - sum(bg.values())
                    - delta.get("slowlog|get", 0)
                    - delta.get("info", 0)
                    - delta.get("slowlog|reset", 0)
                )
                / n,
            }
            log(
                f"  {phase}: {counts[phase]['per_op_total']:.2f} Redis commands per {phase} "
                f"{counts[phase]['per_op_by_command']} (background in window: {bg})"
            )
        # server-side time of the match_prefix script, keys packed vs one argument each, and of open_sequence
        r.slowlog_reset()
        for p in prompts[:100]:
            for script in scripts:
                script(p)
        script_us: dict[str, list[int]] = defaultdict(list)
        for e in slowlog_entries(r, me_addr, shas):
            if not e["in_script"] and e["name"].startswith(("evalsha:match", "evalsha:open_seq")):
                script_us[e["name"]].append(e["us"])
        counts["match_script_server_us"] = {
            k: {
                "p50": statistics.median(v),
                "p99": sorted(v)[min(len(v) - 1, round(0.99 * (len(v) - 1)))],
                "n": len(v),
            }
            for k, v in script_us.items()
        }
        log(f"  match script server time (us): {counts['match_script_server_us']}")
    finally:
        for k, v in old_cfg.items():
            r.config_set(k, v)
        for opened in seqs.values():
            for s in opened:
                if not s.is_closed:
                    s.close()

    return counts
