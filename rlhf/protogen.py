"""Regenerate the checked-in protobuf/gRPC code: ``python -m rlhf.protogen [OUT_DIR]``.

The .proto files live under ``proto/`` laid out as the Python package path (``proto/rlhf/v1/*.proto``) and are compiled
with ``-I proto``, so generated modules import each other as ``rlhf.v1.<name>_pb2``. ``make proto`` writes into the
repository root; the freshness test writes into a temporary directory and compares.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "rlhf" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into ``out_dir/rlhf/v1``; returns the generated files."""
    import grpc_tools  # noqa: PLC0415 - grpcio-tools: dev extra, only to regenerate
    from grpc_tools import protoc  # noqa: PLC0415 - grpcio-tools: dev extra, only to regenerate

    include = Path(grpc_tools.__file__).parent / "_proto"  # well-known types
    (out_dir / "rlhf" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    # protoc resolves relative proto paths against -I, so run it from the proto root.
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    generated = (out_dir / "rlhf" / "v1").iterdir()
    return sorted(p for p in generated if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else ROOT
    for path in generate(out):
        print(path.relative_to(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
