"""Generate the Python stubs of `proto/kv_transfer.proto` into `kv_transfer/` (dev time; committed).

    .venv/bin/python -m kv_transfer.stubs            # rewrite kv_transfer/kv_transfer_pb2*.py

protoc runs with the include mapping `kv_transfer=proto`, so the .proto is compiled as if it lived at
`kv_transfer/kv_transfer.proto`: the generated files land in `kv_transfer/` and import each other as
`from kv_transfer import kv_transfer_pb2` with no post-processing. `tests/unit/test_kv_stubs.py`
regenerates into a temporary directory and compares bytes with the committed files.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "kv_transfer.proto"
GENERATED = ("kv_transfer_pb2.py", "kv_transfer_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc (grpcio-tools) writing `<out_root>/kv_transfer/kv_transfer_pb2*.py`; returns the paths."""
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / "kv_transfer").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-Ikv_transfer={PROTO.parent}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", str(PROTO)]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc}): {' '.join(args)}")
    return [out_root / "kv_transfer" / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    sys.exit(0)
