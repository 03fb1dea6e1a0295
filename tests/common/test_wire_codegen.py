"""The committed wire package is exactly what proto/ generates."""

from services.common import wire_codegen


def test_committed_wire_types_match_the_protos() -> None:
    committed = wire_codegen.WIRE_PACKAGE.read_text()
    assert wire_codegen.generate() == committed, (
        "services/common/wire is stale: run `make wire` (python -m services.common.wire_codegen)")
