"""Property-based fuzzing of the gateway's API with schemathesis: bodies generated from
the request schemas (valid ones, and ones that break the schema on purpose) against the
real mesh. Whatever arrives, the gateway answers below 500 with an OpenAI error object
when it refuses, and the mesh stays whole: every service alive, no request left behind.

The budget and the seed are fixed, so every run sends the same requests. Generation
lengths are capped in the fuzzed schema (max_tokens <= 8, n <= 4) and, for bodies that leave
max_tokens out (the default is the rest of the context), by a mesh of its own with a short
context, to keep the run short; huge values are covered one by one in test_hostile_input.py.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from pydantic.json_schema import models_json_schema

from services.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.faults.streams import poll
from tests.mesh import Mesh, http_get, serving

pytestmark = pytest.mark.slow

SEED = 20261129
MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152   # the embedded model's
# Examples per operation and generation mode.
BUDGET = {"/v1/completions": 30, "/v1/chat/completions": 30, "/tokenize": 15,
          "/detokenize": 15}
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 4, "best_of": 4}
REF = "#/components/schemas/{model}"
# A body without max_tokens generates to the end of the context: keep that short.
SHORT_CONTEXT = ["--max-model-len", "96"]


def fuzz_schema(published: dict[str, Any]) -> dict[str, Any]:
    """The gateway's published OpenAPI schema, with the JSON bodies its handlers parse
    (they read the body themselves, so FastAPI does not list them) and the length caps."""
    schema = copy.deepcopy(published)
    _, definitions = models_json_schema([(m, "validation") for m in BODIES.values()],
                                        ref_template=REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(definitions["$defs"])
    for name in (m.__name__ for m in BODIES.values()):
        properties = components[name]["properties"]
        for field, cap in CAPS.items():
            if field in properties:
                _cap(properties[field], cap)
        # The served model, so that valid bodies get past the model check to the engine.
        properties["model"] = {"type": "string", "enum": [MODEL]}
        if "prompt" in properties:
            _servable_prompt(properties["prompt"])
    # /tokenize needs a prompt or messages, both optional in its schema: valid bodies without
    # either all stop at that 400 (15 of 15 in one CI run), so they carry a prompt.
    required = components[TokenizeRequest.__name__].setdefault("required", [])
    if "prompt" not in required:
        required.append("prompt")
    for path, model in BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(model=model.__name__)}}}}
    return schema


def _servable_prompt(prop: dict[str, Any]) -> None:
    """Prompts the model could run: not empty, token ids inside the vocabulary. Without it
    most valid-by-schema completion bodies stop at those two 400s, and which of the few left
    get through to an answer depends on the draw."""
    prop.update({"minLength": 1} if prop.get("type") == "string" else {})
    if prop.get("type") == "integer":
        prop["maximum"] = VOCAB_SIZE - 1
    if prop.get("type") == "array":
        prop["minItems"] = 1
        _servable_prompt(prop["items"])
    for option in prop.get("anyOf", []):
        _servable_prompt(option)


def _cap(prop: dict[str, Any], cap: int) -> None:
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            option["maximum"] = min(cap, option.get("maximum", cap))


@pytest.fixture(scope="module")
def fuzz_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with serving(Mesh(Path(tmp_path_factory.mktemp("fuzz")), namespace="fuzz",
                      extra_args={"scheduler": SHORT_CONTEXT, "worker": SHORT_CONTEXT})) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def schema(fuzz_mesh: Mesh) -> schemathesis.BaseSchema:
    mesh = fuzz_mesh
    status, body = http_get(f"{mesh.base_url}/openapi.json")
    assert status == 200
    return schemathesis.openapi.from_dict(fuzz_schema(json.loads(body)))


def check(response: requests.Response, case: schemathesis.Case,
          statuses: Counter[int]) -> None:
    statuses[response.status_code] += 1
    assert response.status_code < 500, (case.body, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", list(BODIES))
def test_fuzzed_bodies_never_get_a_server_error(fuzz_mesh: Mesh,
                                                schema: schemathesis.BaseSchema, path: str,
                                                mode: schemathesis.GenerationMode) -> None:
    mesh = fuzz_mesh
    operation = schema[path]["POST"]
    session = requests.Session()
    statuses: Counter[int] = Counter()

    @hypothesis.seed(SEED)
    @settings(max_examples=BUDGET[path], deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        check(case.call(base_url=mesh.base_url, session=session, timeout=120), case,
              statuses)

    fuzz()
    print(f"{path} {mode.value}: statuses {dict(sorted(statuses.items()))}")
    if mode is schemathesis.GenerationMode.POSITIVE and path != "/detokenize":
        assert statuses[200] > 0, "no fuzzed body got through to an answer"
    # The mesh took it all: alive, ready, and nothing left running in the engine.
    assert http_get(f"{mesh.base_url}/health")[0] == 200
    assert all(s.process is not None and s.process.poll() is None
               for s in mesh.services.values())
    poll(lambda: mesh.scheduler_metric("vllm:num_requests_running") == 0
         and mesh.scheduler_metric("vllm:kv_cache_usage_perc") == 0, 60,
         "the engine to be idle after fuzzing")
