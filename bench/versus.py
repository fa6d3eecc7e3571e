"""One benchmark module on two revisions of this repository, interleaved, medians side by side.

    python -m bench.versus --old 037ac64 --module bench.rpc --rounds 3 --keys 'p50' -- --quick
    python -m bench.versus --old 037ac64 --new HEAD --module bench.ttft -- --repeats 3 --no-large

Each revision is extracted with `git archive` (bench/revisions.py) and runs as its own
process, `python -m MODULE ARGS...` in its tree, so both write their results into their own
tree (never this checkout's bench/results). The rounds alternate which revision goes first,
so a drift in the host's load lands on both. With --bench-from new, both run the new
revision's bench module, each with its own revision's pagedkv (for a module that changed
or was broken at the old revision). Every numeric leaf of the module's JSON result
whose dotted path matches --keys is reported: the median over the rounds of each revision,
and new / old. Prints a markdown table, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.revisions import import_root


def numeric_leaves(value: Any, path: str = "") -> dict[str, float]:
    """{dotted path: number} for every int or float (not bool) inside a JSON value."""
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for k, v in value.items():
            out.update(numeric_leaves(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(numeric_leaves(v, f"{path}[{i}]"))
        return out
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {path: float(value)}
    return {}


def run_once(tree: Path, site: Path, module: str, args: list[str], result: str, timeout_s: float) -> dict:
    """MODULE run from `tree` importing pagedkv from `site`; its JSON result."""
    out = tree / "bench" / "results" / result
    out.unlink(missing_ok=True)
    # Run from `site` with the tree after it on the path: the revision's pagedkv (site) and its
    # bench package (tree). From the tree itself, its top-level pagedkv/ folder came first and
    # the editable install filled in the role subpackages from this checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(tree)]), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"{module} in {tree} exited {done.returncode} without {out}:\n{tail}")
    return json.loads(out.read_text())


def compare(runs: dict[str, list[dict]], keys: str) -> list[tuple[str, float, float]]:
    """(path, old median, new median) for every matching leaf present in all runs."""
    pattern = re.compile(keys)
    leaves = {side: [numeric_leaves(r) for r in rs] for side, rs in runs.items()}
    common = set.intersection(*(set(leaf) for rs in leaves.values() for leaf in rs))
    rows = []
    for path in sorted(p for p in common if pattern.search(p)):
        old = statistics.median(leaf[path] for leaf in leaves["old"])
        new = statistics.median(leaf[path] for leaf in leaves["new"])
        rows.append((path, old, new))
    return rows


def render(rows: list[tuple[str, float, float]], names: dict[str, str], meta: dict[str, Any]) -> str:
    lines = [
        f"`python -m {meta['module']} {' '.join(meta['args'])}`, {meta['rounds']} rounds interleaved; "
        f"old = {names['old']}, new = {names['new']}; load average {meta['load_before'][0]:.2f} "
        f"before, {meta['load_after'][0]:.2f} after; {meta['wall_s']:.0f} s.",
        "",
        f"| result | old {names['old']} | new {names['new']} | new / old |",
        "|---|---:|---:|---:|",
    ]
    for path, old, new in rows:
        ratio = f"{new / old:.2f}" if old else "-"
        lines.append(f"| {path} | {old:.4g} | {new:.4g} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the 'before' revision")
    ap.add_argument("--new", default="HEAD", help="the 'after' revision (committed code)")
    ap.add_argument("--module", required=True, help="a benchmark module with a JSON result, e.g. bench.rpc")
    ap.add_argument("--result", help="its result file in bench/results (default: MODULE's name + .json)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", default=".", help="a regex on the results' dotted paths")
    ap.add_argument("--timeout-s", type=float, default=1800, help="per run")
    ap.add_argument("--bench-from", choices=["each", "new"], default="each", help="whose bench module runs")
    ap.add_argument("args", nargs="*", help="the module's own arguments (after --)")
    opts = ap.parse_args(argv)
    if opts.rounds < 1:
        ap.error("--rounds must be >= 1")
    result = opts.result or opts.module.rsplit(".", 1)[-1] + ".json"
    sides = {}
    for side in ("old", "new"):
        site, sha = import_root(getattr(opts, side))
        sides[side] = (site.parent, site, sha)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    load_before, start = os.getloadavg(), time.monotonic()
    for i in range(opts.rounds):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        for side in order:
            tree, site, sha = sides[side]
            if opts.bench_from == "new":
                tree = sides["new"][0]
            print(f"[versus] round {i + 1}/{opts.rounds}: {side} ({sha})", flush=True)
            runs[side].append(run_once(tree, site, opts.module, opts.args, result, opts.timeout_s))
    meta = {
        "module": opts.module,
        "args": opts.args,
        "rounds": opts.rounds,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_s": time.monotonic() - start,
    }
    names = {side: sides[side][2] for side in sides}
    print(render(compare(runs, opts.keys), names, meta))


if __name__ == "__main__":
    main()
