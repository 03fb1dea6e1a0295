"""The committed wire package is exactly what proto/ generates, and it serializes in
compiled code."""

import betterproto

from services.common import wire, wire_codegen
from services.common.packing import pack_int32


def test_committed_wire_types_match_the_protos() -> None:
    committed = wire_codegen.WIRE_PACKAGE.read_text()
    assert wire_codegen.generate() == committed, (
        "services/common/wire is stale: run `make wire` (python -m services.common.wire_codegen)")


def test_messages_serialize_in_compiled_code_and_round_trip() -> None:
    """betterproto's rust-codec extra (a declared dependency) replaces its pure-Python codec:
    a quarter of a per-step message's cost (docs/architecture.md, Messages)."""
    assert betterproto.Message.__bytes__.__name__ == "__bytes_patch"
    assert betterproto.Message.parse.__name__ == "__parse_patch"
    step = wire.StepInput(step=7, num_scheduled_tokens=pack_int32([1, 128]), reset=True,
                          new_requests=[wire.NewRequestData(handle=3, request_id="r",
                                                            sampling=wire.SamplingParams(
                                                                temperature=0.5, max_tokens=9))])
    assert wire.StepInput().parse(bytes(step)) == step
