"""The committed wire packages are exactly what proto/ generates, and both read the same bytes."""

from services.common import wire, wire_codegen, wire_pb
from services.common.packing import pack_int32


def test_committed_wire_types_match_the_protos() -> None:
    committed = wire_codegen.WIRE_PACKAGE.read_text()
    assert wire_codegen.generate() == committed, (
        "services/common/wire is stale: run `make wire` (python -m services.common.wire_codegen)")


def test_committed_upb_modules_match_the_protos() -> None:
    for name, text in wire_codegen.generate_pb().items():
        path = wire_codegen.WIRE_PB_PACKAGE / name
        assert path.exists() and path.read_text() == text, (
            f"services/common/wire_pb/{name} is stale: run `make wire`")


def test_betterproto_and_upb_read_each_others_step_messages() -> None:
    step = wire.StepInput(step=7, new_requests=[wire.NewRequestData(
        handle=3, request_id="r", token_ids=pack_int32([1, 2, 3]), num_prompt_tokens=3,
        sampling=wire.SamplingParams(temperature=0.5, seed=0, logprobs=2, grammar=wire.GrammarSpec(
            kind=wire.GrammarKind.REGEX, spec="a+")),
        lora=wire.LoraRequest(lora_id=2, name="x", path="/a"))],
        cached_handles=pack_int32([4, 5]), reset=True)
    parsed = wire_pb.StepInput.FromString(bytes(step))
    new = parsed.new_requests[0]
    assert (parsed.step, parsed.reset, parsed.cached_handles) == (7, True, step.cached_handles)
    # An optional scalar set to its zero value is still set, on both sides.
    assert new.sampling.HasField("seed") and new.sampling.seed == 0
    assert new.sampling.logprobs == 2 and not new.sampling.HasField("prompt_logprobs")
    assert new.sampling.grammar.kind == wire.GrammarKind.REGEX and new.lora.path == "/a"
    assert wire.StepInput().parse(parsed.SerializeToString()) == step
