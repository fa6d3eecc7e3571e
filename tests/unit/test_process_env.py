"""The environment pagedkv's processes start with (pagedkv/process_env.py), in real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.cluster import LocalCluster
from pagedkv.process_env import DEFAULTS, apply_defaults, child_env

SHOW = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('THP_MEM_ALLOC_ENABLE'))"


def test_apply_defaults_fills_what_is_missing_and_keeps_what_is_set():
    env = {"GOMP_SPINCOUNT": "1000", "PATH": "/bin"}
    apply_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "1000", "PATH": "/bin", "THP_MEM_ALLOC_ENABLE": "1"}
    assert DEFAULTS["GOMP_SPINCOUNT"] == "30000"


def test_child_env_layers_defaults_then_environment_then_extra(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    env = child_env({"PYTHONUNBUFFERED": "1"})
    assert env["GOMP_SPINCOUNT"] == "30000"
    assert env["THP_MEM_ALLOC_ENABLE"] == "0"  # the caller's choice wins
    assert env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("parent, expected", [(None, "30000"), ("1000", "1000")])
def test_processes_the_cluster_starts_get_the_defaults_unless_set(tmp_path, monkeypatch, parent, expected):
    if parent is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", parent)
    cluster = LocalCluster(log_dir=str(tmp_path))
    proc = cluster._spawn("probe", [sys.executable, "-c", SHOW])
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "probe.log").read_text().split() == [expected, "1"]


def test_the_pagedkv_command_sets_them_before_torch_and_warns_when_too_late():
    env = {k: v for k, v in child_env().items() if k not in DEFAULTS}
    code = (
        "import sys, warnings; from pagedkv.cli import main; "
        "sys.argv = ['pagedkv', 'health', '127.0.0.1:9', '--timeout-s', '0.01']; "
        "warnings.simplefilter('error')\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import os; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["30000", "False"]
    late = "import torch, warnings; from pagedkv.process_env import apply_defaults; apply_defaults()"
    cmd = [sys.executable, "-W", "error", "-c", late]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "set after torch was imported" in done.stderr


def test_freeze_at_exit_freezes_before_the_last_hooks_and_files_still_flush(tmp_path):
    out = tmp_path / "left-open.txt"
    code = (
        "import atexit, gc\n"
        "from pagedkv.process_env import freeze_at_exit\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
        "freeze_at_exit()\n"  # registered last: runs first
        f"f = open({str(out)!r}, 'w')\n"
        "f.write('written, never closed')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "frozen True"
    assert out.read_text() == "written, never closed"  # buffered data still reaches the file


def test_freeze_at_exit_leaves_triton_processes_alone():
    pytest.importorskip("triton")
    code = "import triton.language\nfrom pagedkv.process_env import freeze_at_exit\nfreeze_at_exit()\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "nanobind" not in done.stderr  # frozen objects would each be reported as a leak
