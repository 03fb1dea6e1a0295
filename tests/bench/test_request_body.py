"""The bench's request bodies: --extra-body reaches every request, over the defaults."""

from __future__ import annotations

import json

from llm_mesh.bench.openai_client import SamplingOptions, encode_body
from llm_mesh.bench.workloads import SampleRequest


def test_extra_body_is_merged_into_every_request() -> None:
    sample = SampleRequest(prompt="hi", messages=None, output_len=8, tag="random",
                           prompt_len=1)
    extra = {"response_format": {"type": "json_object"}, "temperature": 0.5}
    body = json.loads(encode_body(sample, "m", "completions",
                                  SamplingOptions(extra_body=extra)).body)
    assert body["response_format"] == {"type": "json_object"}
    assert body["temperature"] == 0.5 and body["max_tokens"] == 8 and body["prompt"] == "hi"
