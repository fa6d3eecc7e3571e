# ruff: noqa: E501  (report strings and table rows)
"""Batch-1 events at a paced rate from many nodes (issue 24): what each one-event report costs
the coordinator when reports do not stream back to back.

    python -m bench.scale_events_paced                      # 100 nodes, 1,200 reports/s in all
    python -m bench.scale_events_paced --nodes 1 --rate 1000
    python -m bench.scale_events_paced --flush-s 0.01    # the default flush only

bench.scale sends one node's reports back to back, so one-way reports reach the coordinator
several to a read and one store flush covers many. Here N registered fake nodes (each its own
framed connection, as nodes have) send one-event reports in turn at `--rate` reports a second
in all, so each report arrives alone: one wake-up of its connection's thread, and one script
per node in each flush. Each round sends `--seconds` of reports one-way (NOTIFY), then the same
as framed calls (each waiting for its reply), then asks every node's position once, against a
fresh coordinator for each `--flush-s` in turn (its --event-flush-s: how often a stream of
reports is applied; 1 s leaves the applier nearly idle, so that row is the rpcs' own share);
reported: coordinator CPU per report (/proc, the flushes included), medians over the rounds, in
all and by thread (frame-loop: receiving and queueing; event-applier: the flushes).

Writes bench/results/scale_events_paced.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.scale_cluster import FakeNodes, ScaleCluster, cpu_s, thread_cpu_s
from pagedkv.cache_node.coordinator_link import LINK_WAIT_S
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.framed_client import FramedPort

RESULTS = Path(__file__).parent / "results"
MODES = ("one-way", "framed call")


def log(msg: str) -> None:
    print(f"[events-paced {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(num_nodes: int, rate: float, seconds: float, flush_s: float) -> dict[str, dict[str, float]]:
    """One round against a fresh coordinator applying streams every `flush_s`: mode -> us a
    report, in all ("all") and by thread (the frame loop's, the applier's, ...)."""
    args = ["--event-flush-s", repr(flush_s)]
    cluster = ScaleCluster(Path(tempfile.mkdtemp(prefix="pagedkv-paced-")), 1, 30.0, args)  # no beats due
    ports: list[FramedPort] = []
    try:
        nodes = FakeNodes(cluster, num_nodes)
        nodes.register()
        for _ in range(num_nodes):
            port = FramedPort("127.0.0.1", None, None)
            port.learn(nodes.frame_ports[0])
            ports.append(port)
        pid = cluster.coordinator_pids()[0]
        sent = [0] * num_nodes

        def report(i: int, events: int) -> pb.ReportEventsRequest:
            blocks = [pb.BlockEvent(kind=pb.BlockEvent.STORED, key=os.urandom(16)) for _ in range(events)]
            request = pb.ReportEventsRequest(
                node_id=nodes.ids[i], epoch=nodes.epochs[i], first_seq=sent[i] + 1, events=blocks
            )
            sent[i] += events
            return request

        # Each node's first report costs once, not per report: its link moves to the loop and
        # the coordinator loads the node's event log from the store. Both happen before the window.
        for i in range(num_nodes):
            ports[i].notify("ReportEvents", report(i, 1), 30, may_wait_s=LINK_WAIT_S)
        for i in range(num_nodes):
            ports[i].call("ReportEvents", report(i, 0), pb.ReportEventsResponse, 30)
        count = int(rate * seconds)
        cpu: dict[str, dict[str, float]] = {}
        for mode in MODES:
            c0, by0, t0 = cpu_s(pid), thread_cpu_s(pid), time.perf_counter()
            for k in range(count):
                i = k % num_nodes
                if mode == "one-way":
                    ports[i].notify("ReportEvents", report(i, 1), 30, may_wait_s=LINK_WAIT_S)
                else:
                    ports[i].call("ReportEvents", report(i, 1), pb.ReportEventsResponse, 30)
                due = t0 + (k + 1) / rate
                while (left := due - time.perf_counter()) > 0:
                    time.sleep(left)
            for i in range(num_nodes):  # every report taken (what a beat would ask)
                reply = ports[i].call("ReportEvents", report(i, 0), pb.ReportEventsResponse, 30)
                if reply.next_seq != sent[i] + 1:
                    raise RuntimeError(f"{nodes.ids[i]}: reports not all taken: {reply}")
            time.sleep(max(0.2, 2 * flush_s))  # the last flush lands in this mode's window
            by1 = thread_cpu_s(pid)  # threads before the whole: no thread outruns it
            c1 = cpu_s(pid)
            cpu[mode] = {"all": (c1 - c0) / count * 1e6}
            for name, used in by1.items():
                if (us := (used - by0.get(name, 0.0)) / count * 1e6) > 0:
                    cpu[mode][name] = us
        return cpu
    finally:
        for port in ports:
            port.close()
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument(
        "--rate", type=float, default=1200.0, help="one-event reports a second, all nodes together"
    )
    p.add_argument("--seconds", type=float, default=2.0, help="of reports per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--flush-s",
        default="0.002,0.01,1",
        help="the coordinator's --event-flush-s values, comma-separated (each round runs them in turn)",
    )
    p.add_argument("--out", default=str(RESULTS / "scale_events_paced"), help="output path without extension")
    args = p.parse_args()
    flushes = [float(f) for f in args.flush_s.split(",")]
    load0 = os.getloadavg()[0]
    rounds: dict[float, dict[str, list[dict[str, float]]]] = {f: {m: [] for m in MODES} for f in flushes}
    for r in range(args.rounds):
        for f in flushes if r % 2 == 0 else reversed(flushes):
            for mode, us in run(args.nodes, args.rate, args.seconds, f).items():
                rounds[f][mode].append(us)
                threads = ", ".join(f"{k} {v:.0f}" for k, v in sorted(us.items()) if k != "all")
                log(
                    f"round {r + 1}, flush {f:g} s: {mode}: {us['all']:.0f} us of coordinator CPU a report ({threads})"
                )
    load1 = os.getloadavg()[0]
    result = {
        f"{f:g}": {
            m: {
                "per_report_us": statistics.median(x["all"] for x in v),
                "rounds_us": [x["all"] for x in v],
                "by_thread_us": {
                    name: statistics.median(x.get(name, 0.0) for x in v)
                    for name in sorted({n for x in v for n in x} - {"all"})
                },
            }
            for m, v in by_mode.items()
        }
        for f, by_mode in rounds.items()
    }
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "load": [load0, load1]} | vars(args)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "flushes": result}, indent=2))
    lines = [
        f"# bench.scale_events_paced, {os.cpu_count()} CPUs, load {load0:.1f}-{load1:.1f}",
        "",
        f"{args.nodes} nodes, one-event reports in turn at {args.rate:.0f} a second in all, {args.rounds} rounds of {args.seconds:.0f} s a mode and flush interval.",
        "",
        "| event flush s | sent as | coordinator CPU per report, median us | rounds | by thread (medians, us) |",
        "|---|---|---|---|---|",
        *(
            f"| {f} | {m} | {r['per_report_us']:.0f} | {' / '.join(f'{x:.0f}' for x in r['rounds_us'])} | "
            + ", ".join(f"{k} {v:.0f}" for k, v in r["by_thread_us"].items() if v >= 0.5)
            + " |"
            for f, by_mode in result.items()
            for m, r in by_mode.items()
        ),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wrote {out}.json, .md")


if __name__ == "__main__":
    main()
