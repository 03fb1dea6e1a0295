"""Incremental detokenization with the real SmolLM2 tokenizer."""

import pytest

from services.common import wire
from services.common.model_files import resolve_model
from services.tokenizer.detokenizer import RequestDetokenizer
from services.tokenizer.text_codec import InvalidPrompt, TextCodec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(resolve_model("").hf_dir)


def stream(codec: TextCodec, ids: list[int], params: wire.DetokenizeParams,
           step: int = 1) -> tuple[str, str | None]:
    detok = RequestDetokenizer("r", params, num_prompt_tokens=0)
    out = []
    for start in range(0, len(ids), step):
        text, _, stop = detok.process(codec, ids[start:start + step])
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    return "".join(out) + detok.flush(), None


def test_streamed_text_equals_decoding_at_once(codec: TextCodec) -> None:
    text = "Héllo wörld 😀 — naïve café, 東京 and ünïcödé!\nNew line."
    ids = codec.encode(text, add_special_tokens=False)
    for step in (1, 3):
        streamed, _ = stream(codec, ids, wire.DetokenizeParams(skip_special_tokens=True), step)
        assert streamed == codec.decode(ids) == text


def test_special_tokens_are_skipped_unless_asked(codec: TextCodec) -> None:
    ids = codec.encode("Hi<|im_end|>", add_special_tokens=False)
    assert stream(codec, ids, wire.DetokenizeParams(skip_special_tokens=True))[0] == "Hi"
    assert stream(codec, ids, wire.DetokenizeParams(skip_special_tokens=False))[0] == \
        "Hi<|im_end|>"


def test_stop_string_across_tokens(codec: TextCodec) -> None:
    ids = codec.encode("The answer is forty-two. Done.", add_special_tokens=False)
    text, stop = stream(codec, ids, wire.DetokenizeParams(stop=["forty-two"],
                                                          skip_special_tokens=True))
    assert (text, stop) == ("The answer is ", "forty-two")


def test_chat_template_renders_the_generation_prompt(codec: TextCodec) -> None:
    text = codec.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "Hi" in text
    with pytest.raises(InvalidPrompt):
        codec.render_chat([], add_generation_prompt=True)


def test_a_resumed_request_places_engine_positions_after_the_streamed_tokens(
        codec: TextCodec) -> None:
    streamed = codec.encode("Once upon a time", add_special_tokens=False)
    detok = RequestDetokenizer("r.m1", wire.DetokenizeParams(skip_special_tokens=True), 3)
    detok.resume(codec, streamed, num_chars=len("Once upon a time"))
    # The continuation's engine counts its outputs from 0.
    assert detok.stream_position(0) == detok.num_output_tokens == len(streamed)
    detok.process(codec, codec.encode(" there", add_special_tokens=False))
    assert detok.stream_position(1) == detok.num_output_tokens
    assert detok.stream_position(3) > detok.num_output_tokens     # a batch went missing
