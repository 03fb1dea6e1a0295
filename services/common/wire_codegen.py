"""Generates services/common/wire from proto/*.proto with betterproto.

Run `python -m services.common.wire_codegen` after editing a .proto file; a test fails
when the committed wire package differs from what this produces.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
WIRE_PACKAGE = Path(__file__).resolve().parent / "wire" / "__init__.py"


def generate() -> str:
    """Returns the text of the generated wire package."""
    protos = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    bin_dir = Path(sys.executable).parent  # protoc-gen-python_betterproto lives beside python
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
             f"--plugin=protoc-gen-python_betterproto={bin_dir / 'protoc-gen-python_betterproto'}",
             f"--python_betterproto_out={out}", *protos],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed:\n{done.stderr}")
        return (Path(out) / "wire" / "__init__.py").read_text()


def main() -> None:
    WIRE_PACKAGE.parent.mkdir(exist_ok=True)
    WIRE_PACKAGE.write_text(generate())
    print(f"wrote {WIRE_PACKAGE.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
