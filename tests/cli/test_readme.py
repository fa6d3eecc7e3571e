"""The README's snippets, run as written against the `pagedkv up` command written above each
(so the docs cannot rot): every ```python block that talks to a cluster is paired with the
nearest `pagedkv up ...` line before it in a ```bash block. Only the coordinator port
(50050 -> a free one) and the model path (path/to/model -> a small random model saved here)
are substituted."""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def snippets() -> list[tuple[str, str]]:
    """(the `pagedkv up` command line, the python snippet) for each cluster snippet."""
    out, up = [], ""
    for lang, body in FENCE.findall(README.read_text()):
        if lang == "bash":
            ups = [ln.split("#")[0].strip() for ln in body.splitlines() if ln.startswith("pagedkv up ")]
            up = ups[-1] if ups else up
        elif lang == "python" and ("CacheClient(" in body or "GrpcBackend(" in body):
            assert up, "a cluster snippet with no `pagedkv up` command before it"
            out.append((up, body))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagedkv.client.transformers import demo_model

    path = tmp_path_factory.mktemp("model") / "model"
    model, _ = demo_model(seed=0, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    model.save_pretrained(path)
    return path


def test_readme_has_both_cluster_snippets() -> None:
    found = snippets()
    assert len(found) == 2
    assert "--num-layers 4" in found[0][0] and "CacheClient(" in found[0][1]
    assert "--model path/to/model" in found[1][0] and "GrpcBackend(" in found[1][1]


@pytest.mark.parametrize("index", [0, 1], ids=["client", "transformers"])
def test_readme_snippet_runs_against_its_pagedkv_up(index: int, model_dir: Path, tmp_path: Path) -> None:
    up, code = snippets()[index]
    port = free_port()

    def substitute(text: str) -> str:
        return text.replace("50050", str(port)).replace("path/to/model", str(model_dir))

    argv = shlex.split(substitute(up))
    assert argv[:2] == ["pagedkv", "up"]
    cluster = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", *argv[1:], "--embedded"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert cluster.stdout is not None
        seen = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = cluster.stdout.readline()
            seen.append(line)
            if not line or "Ctrl-C stops everything" in line:
                break
        assert "Ctrl-C stops everything" in seen[-1], "".join(seen)
        script = tmp_path / "snippet.py"
        script.write_text(substitute(code))
        runs = [
            subprocess.run(
                [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
            )
            for _ in range(2)
        ]
        for done in runs:
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        first, second = (done.stdout.strip().splitlines()[-1] for done in runs)
        if index == 0:
            assert first == "0 tokens cached, output (8, 64), K/V (4, 100, 2, 64)"
            assert second == "96 tokens cached, output (8, 64), K/V (4, 100, 2, 64)"  # as the README says
        else:
            assert first == "8 new tokens; cached per row: [0]"
            # 80 prompt tokens: 5 whole blocks, less the one holding the last token
            assert second == "8 new tokens; cached per row: [64]"
    finally:
        cluster.send_signal(signal.SIGINT)
        try:
            cluster.wait(60)
        except subprocess.TimeoutExpired:
            cluster.kill()
            cluster.wait()
