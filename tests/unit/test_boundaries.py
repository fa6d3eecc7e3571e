"""DESIGN.md's import boundaries, checked on the source (every import statement,
absolute or relative, at any depth in a function or module)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("protos", "cache_node", "client", "coordinator")

FORBIDDEN = {
    "protos": {"cache_node", "client", "coordinator"},
    "client": {"cache_node", "coordinator"},
    "cache_node": {"coordinator", "redis"},
    "coordinator": {"cache_node", "torch"},
}


def imported_roots(path: Path, role: str) -> set[str]:
    """Top-level names a file imports, with pagedkv.* and relative imports resolved to roles."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 = this role, level 2 = a sibling role
                mod = (node.module or "").split(".")[0]
                sibling = [mod] if mod else [a.name for a in node.names]
                names = sibling if node.level >= 2 else [role]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            out.add(parts[1] if parts[0] == "pagedkv" and len(parts) > 1 else parts[0])
    return out


@pytest.mark.parametrize("role", ROLES)
def test_role_respects_its_boundary(role: str) -> None:
    files = sorted((ROOT / role).rglob("*.py"))
    if not files:
        pytest.skip(f"{role}/ has no Python files yet")
    bad = {
        str(f.relative_to(ROOT)): sorted(imported_roots(f, role) & FORBIDDEN[role])
        for f in files
        if imported_roots(f, role) & FORBIDDEN[role]
    }
    assert not bad, f"{role} imports what DESIGN.md forbids: {bad}"


def test_checker_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "from ..coordinator import x\nimport pagedkv.cache_node.engine\ndef g():\n    import redis\n"
    )
    assert imported_roots(f, "client") >= {"coordinator", "cache_node", "redis"}
