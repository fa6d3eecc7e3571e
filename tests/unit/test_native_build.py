"""native_build: an empty cached library is rebuilt, and a compile that writes nothing fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagedkv.protos import native_build

SOURCE = "int pagedkv_answer(void) { return 42; }\n"


@pytest.fixture
def cc() -> str:
    compiler = native_build.find_compiler("CC", ("cc", "gcc", "clang"))
    if compiler is None:
        pytest.skip("no C compiler")
    return compiler


def test_empty_cached_library_is_removed_and_rebuilt(tmp_path: Path, cc: str) -> None:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    library = tmp_path / "answer.so"
    library.write_bytes(b"")  # what a build that claimed success without output leaves
    assert not native_build.is_built(library)
    assert not library.exists()
    native_build.compile_library(cc, source, library, [("-O1", "-shared", "-fPIC")], 60)
    assert native_build.is_built(library)
    assert library.stat().st_size > 0


def test_compiler_that_writes_nothing_is_a_failure(tmp_path: Path) -> None:
    true = shutil.which("true")
    if true is None:
        pytest.skip("no `true` binary")
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    library = tmp_path / "answer.so"
    with pytest.raises(OSError, match="empty library"):
        native_build.compile_library(true, source, library, [("-shared",)], 10)
    assert not library.exists()
    assert list(tmp_path.iterdir()) == [source]  # the private temporary file is gone too
