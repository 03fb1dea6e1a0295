"""Generates the two Python views of proto/*.proto.

- services/common/wire: betterproto dataclasses, what every service builds and reads.
- services/common/wire_pb: the official protobuf runtime's classes (upb, in C) for the
  messages sent every step (common.proto, engine.proto, tokenizer.proto): a scheduler and
  its worker exchange a step every few milliseconds, and each step's tokens go on to a
  tokenizer and its text to a gateway; betterproto spends ~0.1-0.5 ms building,
  serializing or parsing each of those messages where upb spends microseconds. Both views
  read and write the same bytes.

Run `python -m services.common.wire_codegen` after editing a .proto file; a test fails
when the committed packages differ from what this produces.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
WIRE_PACKAGE = Path(__file__).resolve().parent / "wire" / "__init__.py"
WIRE_PB_PACKAGE = Path(__file__).resolve().parent / "wire_pb"
WIRE_PB_PROTOS = ("common.proto", "engine.proto", "tokenizer.proto")
# NOTE: upb registers every file and message in one process-wide pool, where a name taken
# twice fails the import: ours get a directory and a package no other library uses.
_PB_DIR = "llm_mesh_wire"
_PB_PACKAGE = "llm_mesh.wire"


def generate() -> str:
    """Returns the text of the generated wire package."""
    protos = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    # protoc-gen-python_betterproto lives beside python
    plugin = Path(sys.executable).parent / "protoc-gen-python_betterproto"
    with tempfile.TemporaryDirectory() as out:
        _protoc(f"-I{PROTO_DIR}", f"--plugin=protoc-gen-python_betterproto={plugin}",
                f"--python_betterproto_out={out}", *protos)
        return (Path(out) / "wire" / "__init__.py").read_text()


def generate_pb() -> dict[str, str]:
    """Returns the files of the generated wire_pb package: file name -> text."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        (src / _PB_DIR).mkdir(parents=True)
        out.mkdir()
        for name in WIRE_PB_PROTOS:
            text = (PROTO_DIR / name).read_text().replace("package wire;",
                                                          f"package {_PB_PACKAGE};")
            text = re.sub(r'import "(\w+\.proto)";', rf'import "{_PB_DIR}/\1";', text)
            (src / _PB_DIR / name).write_text(text)
        _protoc(f"-I{src}", f"--python_out={out}", f"--pyi_out={out}",
                *(f"{_PB_DIR}/{name}" for name in WIRE_PB_PROTOS))
        files = {}
        for path in sorted((out / _PB_DIR).iterdir()):
            files[path.name] = path.read_text().replace(
                f"from {_PB_DIR} import", "from services.common.wire_pb import")
        return files


def _protoc(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed:\n{done.stderr}")


def main() -> None:
    WIRE_PACKAGE.parent.mkdir(exist_ok=True)
    WIRE_PACKAGE.write_text(generate())
    print(f"wrote {WIRE_PACKAGE.relative_to(REPO_ROOT)}")
    for name, text in generate_pb().items():
        (WIRE_PB_PACKAGE / name).write_text(text)
        print(f"wrote {(WIRE_PB_PACKAGE / name).relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
