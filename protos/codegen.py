"""Regenerate the gRPC stubs from protos/pagedkv.proto: the one codegen command.

    python -m pagedkv.protos.codegen            # writes protos/pagedkv_pb2{.py,.pyi,_grpc.py}
    python -m pagedkv.protos.codegen --out DIR  # writes them into DIR (the drift test)

Runs grpc_tools.protoc with --python_out, --grpc_python_out and --pyi_out, then
makes the import in `_pb2_grpc.py` package-relative (protoc writes a top-level
`import pagedkv_pb2`, which only works with protos/ on sys.path). The outputs are
committed and never hand-edited; tests/unit/test_codegen_drift.py fails on drift.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("pagedkv.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_names() -> list[str]:
    return [Path(p).stem + s for p in PROTO_FILES for s in GENERATED_SUFFIXES]


def generate(out_dir: Path) -> list[Path]:
    """Write the generated files for every proto into out_dir; return their paths."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        stem = Path(proto).stem
        grpc_file = out_dir / f"{stem}_pb2_grpc.py"
        text = grpc_file.read_text()
        fixed = text.replace(f"import {stem}_pb2 as", f"from . import {stem}_pb2 as")
        if fixed == text:
            raise RuntimeError(f"expected a top-level 'import {stem}_pb2' in {grpc_file.name}")
        grpc_file.write_text(fixed)
    return [out_dir / name for name in generated_names()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder (default: protos/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
