"""Every benchmark module under bench/ with a `__main__`, run at its smallest size so none
can rot: each is a real process (real nodes, a real redis-server for bench.control) that
must exit 0 and write the results its report is made from. bench.cluster has its own end
to end test (tests/cluster/test_bench_cluster.py). The figures are not checked: at these
sizes they mean nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.workloads import TRACE

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PAGEDKV_PEERS") or ROOT.parent / "shared" / "peers")
if not PEERS.is_dir():
    PEERS = ROOT.parents[1] / "shared" / "peers"  # a worktree beside the main checkout


def run_bench(module: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PAGEDKV_PEERS": str(PEERS)}
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{(done.stderr or done.stdout)[-3000:]}"
    return done


def needs_peers() -> None:
    if not (PEERS / "kvbench").is_dir():
        pytest.skip(f"the peers' kvbench is not at {PEERS} (set PAGEDKV_PEERS)")


def test_attention(tmp_path: Path) -> None:
    run_bench("bench.attention", "--smoke", "--out", str(tmp_path))
    report = json.loads((tmp_path / "attention.json").read_text())
    assert report["shapes"] and all(shape["seq_len"] == 128 for shape in report["shapes"])


def test_attention_mods() -> None:
    done = run_bench("bench.attention_mods", "--length", "256", "--repeats", "2")
    assert "softcap+sinks" in done.stdout and "kernel" in done.stdout


def test_open_wait() -> None:
    done = run_bench("bench.open_wait", "--opens", "5")
    for mode in ("await the node's Open", "answer at once (pagedkv)"):
        assert mode in done.stdout and "(n=5)" in done.stdout, done.stdout


def test_hitrate(tmp_path: Path) -> None:
    # The public trace lives beside the checkout (../shared), not in it: a clone elsewhere
    # (CI) replays the generated chat workload only.
    names = ["chat-light"] + (["trace1000"] if TRACE.exists() else [])
    run_bench(
        "bench.hitrate",
        "--quick",
        "--workloads",
        ",".join(names),
        "--policies",
        "lru,lfu",
        "--out",
        str(tmp_path),
    )
    results = json.dumps(json.loads((tmp_path / "hitrate_quick.json").read_text()))
    assert all(name in results for name in names)
    assert (tmp_path / "hitrate_quick.md").read_text().count("|") > 4


def test_memory_waste(tmp_path: Path) -> None:
    needs_peers()
    run_bench("bench.memory_waste", "--out", str(tmp_path))
    result = json.loads((tmp_path / "memory_waste.json").read_text())
    assert 0.0 <= result["paged_waste"] < result["contiguous_waste"] < 1.0


def test_rpc(tmp_path: Path) -> None:
    run_bench("bench.rpc", "--smoke", "--out", str(tmp_path))
    results = json.loads((tmp_path / "rpc.json").read_text())
    assert results["latency"] and results["transfer"] == {}
    assert "RPC overhead" in (tmp_path / "rpc.md").read_text()


def test_security(tmp_path: Path) -> None:
    run_bench("bench.security", "--smoke", "--out", str(tmp_path))
    results = json.loads((tmp_path / "security.json").read_text())
    assert results["attend"] and results["transfer"] and results["check"]


def test_ttft(tmp_path: Path) -> None:
    run_bench("bench.ttft", "--smoke", "--out", str(tmp_path), timeout_s=400)
    report = json.loads((tmp_path / "ttft.json").read_text())
    assert list(report["models"]) == ["small"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="bench.control needs redis-server")
def test_control(tmp_path: Path) -> None:
    args = ("--rounds", "5", "--count-ops", "3", "--profile-s", "0", "--concurrency", "1")
    run_bench("bench.control", *args, "--out", str(tmp_path), timeout_s=400)
    result = json.loads((tmp_path / "control.json").read_text())
    assert result["rounds"] == 5 and result["redis_commands"]["open"]["ops"] == 3
    assert "open" in result["latency"] and (tmp_path / "control.md").read_text().count("|") > 10


def test_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our adapters alone run on this interpreter: the peers' venv (a pip install that can
    fail where their wheels are not served) is neither built nor needed."""
    needs_peers()
    monkeypatch.setenv("PEERS_VENV", str(tmp_path / "no-venv"))
    args = ("--runs", "1", "--workloads", "W1", "--adapters", "pagedkv,harness-floor")
    run_bench("bench.blocks", *args, "--out", str(tmp_path), timeout_s=400)
    assert "| W1 | pagedkv |" in (tmp_path / "blocks.md").read_text()
    assert not (tmp_path / "no-venv").exists()


def test_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        done = subprocess.run(
            [sys.executable, "-m", "bench.gpu", "--quick", "--out", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and "needs a CUDA device" in (done.stdout + done.stderr)
        return
    run_bench("bench.gpu", "--quick", "--out", str(tmp_path), timeout_s=400)
    assert (tmp_path / "gpu.json").exists()


def test_versus_runs_one_module_on_two_revisions() -> None:
    needs_peers()
    done = run_bench(
        "bench.versus", "--old", "HEAD", "--new", "HEAD", "--module", "bench.memory_waste", "--rounds", "1"
    )
    assert "| paged_waste |" in done.stdout and "| 1.00 |" in done.stdout


def test_versus_runs_the_revisions_own_code(tmp_path: Path) -> None:
    """Each side imports its own revision's pagedkv, not this checkout's (the editable
    install maps the role subpackages here, which once made both sides run the new code)."""
    from bench.revisions import import_root
    from bench.versus import run_once

    site, _ = import_root("HEAD")
    tree = tmp_path / "tree"
    (tree / "bench" / "results").mkdir(parents=True)
    (tree / "pagedkv").mkdir()  # like an archived revision: a top-level pagedkv/ without roles
    (tree / "pagedkv" / "__init__.py").write_text("")
    (tree / "probe.py").write_text(
        "import json, pathlib, pagedkv.cache_node as m\n"
        "out = pathlib.Path(__file__).parent / 'bench/results/probe.json'\n"
        "out.write_text(json.dumps({'file': m.__file__}))\n"
    )
    found = Path(run_once(tree, site, "probe", [], "probe.json", 60)["file"]).resolve()
    assert found.is_relative_to(site.parent.resolve()) and not found.is_relative_to(ROOT), found


def test_sharded(tmp_path: Path) -> None:
    done = run_bench("bench.sharded", "--smoke", "--pin-nodes", "--out", str(tmp_path))
    assert "3 nodes" in done.stdout and "nodes pinned to cores" in done.stdout
    result = json.loads((tmp_path / "sharded.json").read_text())
    modes = {"1 node", "2 nodes", "3 nodes", "2 nodes, one by one"}
    assert set(result["seconds"]) == set(result["ratio"]) == modes and result["pinned"] is True
    assert result["ratio"]["1 node"] == 1.0
    # one by one makes the same calls: 2 a layer, each answered before the next is sent
    assert "2 nodes, one by one" in done.stdout and "2.0 calls a layer" in done.stdout


def test_sharded_past_a_nodes_pool_and_with_a_budget(tmp_path: Path) -> None:
    done = run_bench("bench.sharded", "--smoke", "--pool-fraction", "0.4", "--out", str(tmp_path))
    result = json.loads((tmp_path / "sharded_pool.json").read_text())
    spread = [m for m in result["seconds"] if not m.endswith("one by one") and m != "1 node"]
    assert len(spread) == 1 and int(spread[0].split()[0]) >= 2, result["seconds"].keys()  # it spilled
    assert "1.0 calls a layer" in done.stdout and result["pool_fraction"] == 0.4
    done = run_bench("bench.sharded", "--smoke", "--budget", "128", "--out", str(tmp_path))
    result = json.loads((tmp_path / "sharded_budget.json").read_text())
    assert result["budget"] == 128 and "token budget 128" in done.stdout
