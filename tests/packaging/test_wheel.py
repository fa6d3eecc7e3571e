"""The wheel as a user installs it: built from a copy of the tree, installed into fresh venvs
with the same pip and constraints this project uses, never the editable dev install.

- its contents and metadata (the proto, py.typed, LICENSE, URLs, ranges instead of pins);
- a coordinator install (`pagedkv[coordinator]`) that has no torch and runs its commands;
- a worker's install beside a torch pinned first, as vLLM or SGLang pin theirs (the wheel
  `--no-deps`, then its client extra under constraints: that torch stays), which imports the
  client without transformers and says what to install for `pagedkv demo`.

Installs come from the indexes and wheels already on this machine; the venvs are made
without pip (this interpreter's pip installs into them with --python), so each costs seconds.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
SKIP = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "tests",
    "bench",
    "deploy",
    "docs",
    "pagedkv-demo",
)
pytestmark = pytest.mark.timeout(600)


def pip(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the built wheel, the build's output)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # builds leave build/ and egg-info behind: not in the tree
    done = pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src))
    (built,) = (tmp / "dist").glob("pagedkv-*.whl")
    return built, done.stdout + done.stderr


def fresh_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def install(python: Path, *args: str) -> None:
    pip("--python", str(python), "install", "-q", "-c", str(CONSTRAINTS), *args, timeout_s=600)


def run_in(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # cwd outside the repo, so nothing is imported from the source tree
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_wheel_builds_cleanly_with_the_proto_types_and_license(wheel: tuple[Path, str]) -> None:
    path, output = wheel
    warnings = [ln for ln in output.splitlines() if "warning" in ln.lower() and "is ignored" not in ln]
    assert not warnings, "\n".join(warnings)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    needed = {
        "pagedkv/protos/pagedkv.proto",
        "pagedkv/protos/pagedkv_pb2.pyi",
        "pagedkv/py.typed",
        "pagedkv/cache_node/csrc/paged_attention.cpp",
        "pagedkv/cache_node/csrc/block_core.c",
        "pagedkv/protos/csrc/chain_keys.c",
        "pagedkv/coordinator/csrc/rank_rooms.c",
        "pagedkv/client/sync.py",
        "pagedkv/coordinator/cli.py",
    }
    assert needed <= names, needed - names
    # Every module of every role ships: a subpackage left out of pyproject's list fails here.
    roles = {
        "pagedkv": "pagedkv",
        "protos": "pagedkv/protos",
        "cache_node": "pagedkv/cache_node",
        "client": "pagedkv/client",
        "coordinator": "pagedkv/coordinator",
    }
    sources = {
        f"{dest}/{py.relative_to(ROOT / src).as_posix()}"
        for src, dest in roles.items()
        for py in (ROOT / src).rglob("*.py")
        if "__pycache__" not in py.parts
    }
    assert sources <= names, sorted(sources - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    assert meta["License-Expression"] == "Apache-2.0"
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} >= {"Homepage", "Source", "Changelog"}
    requires = meta.get_all("Requires-Dist")
    assert not [r for r in requires if "==" in r.split(";")[0]], requires  # ranges only: co-installable
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if r.startswith(("torch", "redis", "transformers", "prometheus"))], base
    assert set(meta.get_all("Provides-Extra")) >= {"client", "node", "coordinator", "hf", "all", "dev"}


def test_coordinator_installs_and_runs_without_torch(wheel: tuple[Path, str], tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "coordinator")
    install(python, f"{wheel[0]}[coordinator]")
    code = (
        "import importlib.util, sys\nimport pagedkv.coordinator.cli, pagedkv.status\n"
        "print(importlib.util.find_spec('torch') is None, 'torch' in sys.modules)"
    )
    done = run_in(python, "-c", code, cwd=tmp_path)
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
    cli = python.parent / "pagedkv"
    assert run_in(cli, "--version", cwd=tmp_path).stdout.startswith("pagedkv ")
    assert run_in(cli, "coordinator", "--help", cwd=tmp_path).returncode == 0
    status = run_in(cli, "status", "--coordinator", "127.0.0.1:9", "--timeout-s", "1", cwd=tmp_path)
    assert status.returncode == 1 and "UNAVAILABLE" in status.stderr, status.stderr  # ran, without torch
    node = run_in(cli, "node", "--num-blocks", "4", cwd=tmp_path)
    assert node.returncode == 2 and "Traceback" not in node.stderr
    assert node.stderr.strip() == (
        "pagedkv: error: `pagedkv node` needs torch, which is not installed: pip install 'pagedkv[node]'"
    )


def test_client_installs_beside_a_pinned_torch_without_transformers(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    python = fresh_venv(tmp_path / "worker")
    install(python, "torch")  # the inference engine's own pin, installed first (constraints: 2.13.0)
    install(python, "--no-deps", str(wheel[0]))
    install(python, f"{wheel[0]}[client]")  # resolves around the torch that is there
    code = (
        "import importlib.util, sys, torch\nimport pagedkv.client\n"
        "print(torch.__version__.split('+')[0], importlib.util.find_spec('transformers') is None,"
        " 'redis' in sys.modules, 'prometheus_client' in sys.modules)"
    )
    done = run_in(python, "-c", code, cwd=tmp_path)
    (pin,) = [ln for ln in CONSTRAINTS.read_text().splitlines() if ln.startswith("torch==")]
    pinned = pin.split("==")[1].strip()
    assert done.stdout.split() == [pinned, "True", "False", "False"], done.stdout + done.stderr
    demo = run_in(python.parent / "pagedkv", "demo", cwd=tmp_path)
    assert demo.returncode == 2 and "Traceback" not in demo.stderr
    assert "`pagedkv demo` needs" in demo.stderr and "pip install 'pagedkv[all]'" in demo.stderr
