"""What awaiting the node's Open would cost an open (issue 18, the open vs the node's
background Open).

Two ways to keep a data call from overtaking its sequence's Open: the coordinator answers
the open only once the node has opened it (`Coordinator.open(wait=True)`), or it answers at
once and a data call that presents a current ticket for an id the node does not know yet
waits for that Open (bounded by the lease; cache_node/gate.py) -- what pagedkv does. This
times both from one coordinator (in this process) against a real redis-server and a real
node process, alternating the two modes, each open closed right after.

    python -m bench.open_wait [--opens 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.store import open_store

NODE = NodeOptions(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_size=16, num_blocks=2048)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--opens", type=int, default=300, help="opens per mode")
    args = p.parse_args()
    with LocalCluster(1, NODE, secure=False, log_dir=tempfile.mkdtemp(prefix="open-wait-")) as cluster:
        coordinator = Coordinator(open_store(cluster.redis_url), CoordinatorConfig())
        try:
            coordinator.refresh_nodes()
            times: dict[bool, list[float]] = {False: [], True: []}
            prompt = list(range(1000, 1000 + 200))
            for i in range(2 * args.opens + 20):
                wait = bool(i % 2)
                start = time.perf_counter()
                coordinator.open("default", prompt + [i], seq_id=f"ow-{i}", wait=wait)
                took = time.perf_counter() - start
                coordinator.close("default", f"ow-{i}")
                if i >= 20:  # warm-up: channels, scripts
                    times[wait].append(took)
            coordinator.wait_idle()
        finally:
            coordinator.stop()
    for wait, samples in times.items():
        ms = sorted(t * 1e3 for t in samples)
        p99 = ms[int(0.99 * (len(ms) - 1))]
        name = "await the node's Open" if wait else "answer at once (pagedkv)"
        print(f"{name:28s} p50 {statistics.median(ms):.3f} ms  p99 {p99:.3f} ms  (n={len(ms)})")


if __name__ == "__main__":
    main()
