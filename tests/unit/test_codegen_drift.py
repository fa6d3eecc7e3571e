"""The checked-in stubs are exactly what the one codegen command produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.protos import codegen

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) regenerates the stubs")


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    fresh = codegen.generate(tmp_path)
    stale = [p.name for p in fresh if (codegen.PROTO_DIR / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"{stale} drifted from pagedkv.proto: run `python -m pagedkv.protos.codegen`"
