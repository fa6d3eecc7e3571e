"""Opens at saturation for bench.scale: `clients` processes open and close a prompt as fast as
the coordinators answer, for a fixed window, while every fake node beats; reported: open+close
per second, the coordinators' cores over the window (/proc, beats included) and their ratio,
opens per second per coordinator core.

One client at a time (bench.scale's sequential opens) leaves the coordinator idle between
calls: each call then pays a thread's wake-up from idle, which on this VM is a large part of a
small call. A saturated coordinator takes calls back to back; the goal's "opens/s per core" is
its rate there. Each client is its own process (the bench process runs the fake nodes' beats,
which must not wait on a load generator's GIL).

    python -m bench.scale_throughput --client ...   # one client process (bench.scale starts them)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.scale_cluster import SPEC, ScaleCluster, cpu_s
from pagedkv.client.sent_prompts import SentPrompts
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import PagedKVError, Unavailable
from pagedkv.protos.framed_client import FramedPort
from pagedkv.protos.prompt import pack

START_GAP_S = 0.2  # between the last client saying it is ready and the window opening


def measure_throughput(
    cluster: ScaleCluster,
    frame_ports: list[int],
    prompt: list[int],
    clients: int,
    seconds: float,
    tag: str,
    lists: bool = False,
    whole: bool = False,
) -> dict[str, Any]:
    """`clients` processes, each on one coordinator's framed port in turn, for `seconds`
    (`lists`: each prompt a Python list, not an array; `whole`: every prompt sent whole, no
    start named by a ref).
    The window opens once every client has imported and connected (a fixed delay was too
    short where the clients share one CPU with the fake nodes: --pin)."""
    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        np.save(f, np.asarray(prompt, dtype=np.int64))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.scale_throughput", "--client"]
            + ["--port", str(frame_ports[i % len(frame_ports)]), "--prompt", f.name]
            + ["--seconds", repr(seconds), "--tag", f"{tag}-{i}"]
            + (["--lists"] if lists else [])
            + (["--whole"] if whole else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(clients)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            for other in procs:  # the others wait on stdin for a start that never comes
                other.kill()
            raise RuntimeError(f"a throughput client did not start ({proc.wait()})")
    start_at = time.time() + START_GAP_S
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start_at!r}\n")
        proc.stdin.close()
    pids = cluster.coordinator_pids()
    time.sleep(max(0.0, start_at - time.time()))
    c0, t0 = sum(cpu_s(p) for p in pids), time.perf_counter()
    time.sleep(seconds)
    c1, t1 = sum(cpu_s(p) for p in pids), time.perf_counter()
    counts = []
    for proc in procs:
        assert proc.stdout is not None
        out = proc.stdout.read()  # (its stdin is closed: not communicate())
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"a throughput client failed ({proc.returncode}): {out[-500:]}")
        counts.append([int(x) for x in out.split()])
    Path(f.name).unlink()
    done = sum(c[0] for c in counts)
    rate = done / seconds
    cores = (c1 - c0) / (t1 - t0)
    return {
        "clients": clients,
        "seconds": seconds,
        "open_close_per_s": rate,
        "coord_cores": cores,
        "opens_per_s_per_core": rate / cores if cores else float("nan"),
        "coord_cpu_per_open_close_ms": cores / rate * 1e3 if rate else float("nan"),
        "retried": sum(c[1] for c in counts),
    }


def _client(
    port: int, prompt_path: str, seconds: float, tag: str, lists: bool = False, whole: bool = False
) -> None:
    """Open + close (the client's framed default: prompt packed and carried) until the window
    ends; says "ready" once connected, reads when the window opens from stdin, and prints the
    pairs completed inside the window and the UNAVAILABLE retries. Each prompt is an int64
    array (`lists`: a Python list, whose packing took this client ~1.5 ms of a 32k open: on 2
    cores shared with the coordinator and Redis the clients then held the rate, not it). As the
    client library does, the start a prompt shares with the last one goes as that one's ref
    (client/sent_prompts.py), unless `whole`."""
    prompt = np.load(prompt_path)
    sent = SentPrompts()
    framed = FramedPort("127.0.0.1", None, None)
    framed.learn(port)
    # connected before the window (a close of an id never opened succeeds, changing nothing)
    framed.call("Close", pb.CoordSeqRequest(seq_id=f"{tag}-connect", freed_extents=1), pb.Empty, 60)
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    block = SPEC.block_size
    done = retried = n = 0
    time.sleep(max(0.0, start_at - time.time()))
    end = start_at + seconds
    while time.time() < end:
        seq_id = f"{tag}-{n}"
        tail = [2_000_000 + n] * block + [7]  # a unique block after the shared prompt
        tokens = prompt.tolist() + tail if lists else np.concatenate((prompt, np.asarray(tail, np.int64)))
        packed = pack(tokens) or b""
        req = pb.CoordOpenRequest(seq_id=seq_id, packed_token_ids=packed, worker_opens=True)
        req.carries_prompt = True
        if not whole:
            sent.fill(req, packed)
        reply = framed.call("Open", req, pb.CoordOpenResponse, 60)
        if not whole:
            sent.learn(packed, reply)
        while True:
            try:
                framed.call("Close", pb.CoordSeqRequest(seq_id=seq_id, freed_extents=1), pb.Empty, 60)
                break
            except Unavailable:  # a suspect node (a late beat on a loaded host): as a worker retries
                retried += 1
                time.sleep(0.05)
        n += 1
        done += time.time() <= end
    framed.close()
    print(done, retried)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scale_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--client", action="store_true", required=True, help="run one client (bench.scale starts them)"
    )
    p.add_argument("--port", type=int, required=True, help="the coordinator's framed port")
    p.add_argument("--prompt", required=True, help="the prompt's tokens (.npy)")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--tag", required=True, help="sequence id prefix")
    p.add_argument("--lists", action="store_true", help="send each prompt as a Python list")
    p.add_argument("--whole", action="store_true", help="send each prompt whole (no ref)")
    args = p.parse_args()
    try:
        _client(args.port, args.prompt, args.seconds, args.tag, args.lists, args.whole)
    except PagedKVError as exc:
        sys.exit(f"throughput client: {exc}")


if __name__ == "__main__":
    main()
