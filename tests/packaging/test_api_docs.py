"""`make docs`: the API reference builds from the docstrings (pdoc, as the Makefile runs it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_builds_from_the_docstrings(tmp_path: Path) -> None:
    pytest.importorskip("pdoc", reason="pdoc is in the dev extra (pip install -e '.[dev]')")
    recipe = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "pdoc --docformat" in ln)
    modules = re.search(r"-o build/api (.*)$", recipe)
    assert modules, recipe
    # the Makefile's module list, minus the generated stubs' pattern (quoted for the shell there)
    names = [m for m in modules.group(1).split() if not m.startswith("'!")]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdoc",
            "--docformat",
            "markdown",
            "--no-show-source",
            "-o",
            str(tmp_path),
            *names,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PDOC_ALLOW_EXEC": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client = (tmp_path / "pagedkv" / "client.html").read_text()
    assert "CacheClient" in client and "AsyncCacheClient" in client
    assert (tmp_path / "pagedkv" / "coordinator" / "store.html").exists()
    assert (tmp_path / "pagedkv" / "cache_node" / "engine.html").exists()
