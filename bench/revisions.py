"""Another git revision's code, importable beside this checkout's: for before/after runs in
one process tree (bench.control's baseline coordinator, bench.versus)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def import_root(rev: str) -> tuple[Path, str]:
    """(a folder to put first on PYTHONPATH so `import pagedkv` runs `rev`'s code, its short hash).

    `git archive` of the revision into a temporary folder (the shared checkout and its
    worktree list are untouched), and a `pagedkv` package there that maps the roles'
    top-level folders the way the editable install does (pyproject's package-dir)."""
    repo = Path(__file__).resolve().parent.parent
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"pagedkv-baseline-{sha}"
    if not (tree / "coordinator").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pkg = tree / "import" / "pagedkv"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for f in (tree / "pagedkv").iterdir():
            (pkg / f.name).symlink_to(f)
        for role in ("protos", "cache_node", "client", "coordinator"):
            (pkg / role).symlink_to(tree / role)
    return tree / "import", sha
