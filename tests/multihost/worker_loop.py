"""A long-lived worker process for the multi-host tests: imports torch once,
then runs tests/cluster/worker.py's scenario (open, append the uncached rest,
one decode step per layer checked against a dense reference) for each JSON
request read from stdin, answering one JSON line on stdout.

    python tests/multihost/worker_loop.py COORDINATOR TOKEN
    stdin:  {"seq_id": "a", "prompt": [1, 2, 3], "keep": false}
    stdout: {"ready": true} once, then worker.py's result line (or {"error": ...}) per request
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import traceback
from pathlib import Path

from pagedkv.process_env import freeze_at_exit

WORKER = Path(__file__).resolve().parents[1] / "cluster" / "worker.py"


def main() -> None:
    coordinator, token = sys.argv[1:3]
    spec = importlib.util.spec_from_file_location("pagedkv_cluster_worker", WORKER)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # imports torch and the client
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        argv = ["worker.py", coordinator, req["seq_id"], token, json.dumps(req["prompt"])]
        out = io.StringIO()
        try:
            sys.argv = argv + (["--keep"] if req.get("keep") else [])
            with contextlib.redirect_stdout(out):
                worker.main()
            reply = out.getvalue().strip().splitlines()[-1]
        except Exception:
            reply = json.dumps({"error": traceback.format_exc()[-3000:]})
        print(reply, flush=True)


if __name__ == "__main__":
    freeze_at_exit()  # exits in a fraction of a second, not seconds, with torch loaded
    main()
