"""Regenerate the committed gRPC stubs: `python -m proto.generate [--out DIR]`.

Runs exactly:
    python -m grpc_tools.protoc -I proto --python_out=DIR --grpc_python_out=DIR
        --pyi_out=DIR proto/kv_transfer.proto
then rewrites the generated `import kv_transfer_pb2` in *_pb2_grpc.py to
`from proto import kv_transfer_pb2` so the stubs import as a package.
tests/test_kv_transfer_proto.py generates into a temp dir and compares byte for byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
NAMES = ["kv_transfer"]


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs of every proto in NAMES into `out_dir`; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in NAMES:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}",
            str(PROTO_DIR / f"{name}.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {name}.proto")
        grpc_file = out_dir / f"{name}_pb2_grpc.py"
        text = grpc_file.read_text()
        grpc_file.write_text(
            text.replace(f"import {name}_pb2 as", f"from proto import {name}_pb2 as")
        )
        written += [out_dir / f"{name}_pb2.py", out_dir / f"{name}_pb2.pyi", grpc_file]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR)
    for path in generate(parser.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
