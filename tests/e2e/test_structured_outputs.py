"""Structured outputs on the real mesh, through the official openai client: every constraint
spelling (a structural tag in response_format too), chat and completions, streaming, n > 1,
bad grammars as 400s, the tokenizer's compile cache, a gateway with a reasoning parser, and a
batch line."""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

import jsonschema
import openai
import pytest

from services.common.ports import free_port
from tests.batch.polling import finished, wait_for
from tests.faults.streams import poll
from tests.mesh import Mesh, http_get, metric_value

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
    "required": ["name", "age", "city"]}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PERSON_PROMPT = "Describe a person as JSON with a name, an age and a city."
SQL_GRAMMAR = """root ::= "SELECT " column " FROM " table (" WHERE " column " = " number)?
column ::= "name" | "age" | "city"
table ::= "users" | "people"
number ::= [1-9] [0-9]?"""
SQL = re.compile(r"SELECT (name|age|city) FROM (users|people)( WHERE (name|age|city) = "
                 r"[1-9][0-9]?)?")


def chat(client: openai.OpenAI, model: str, content: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kwargs)


def structured(**options: Any) -> dict[str, Any]:
    return {"structured_outputs": options}


def test_json_schema_output_validates(client: openai.OpenAI, model_name: str) -> None:
    out = chat(client, model_name, PERSON_PROMPT, response_format=PERSON_FORMAT,
               temperature=0, max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_parses(client: openai.OpenAI, model_name: str) -> None:
    out = chat(client, model_name, 'Reply with a JSON object with one key, "answer", holding '
               "the capital of France.", response_format={"type": "json_object"},
               temperature=0, max_tokens=40)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_choice_regex_and_grammar(client: openai.OpenAI, model_name: str) -> None:
    out = chat(client, model_name, "Is the sky blue?", temperature=0, max_tokens=10,
               logprobs=True, top_logprobs=5, extra_body=structured(choice=["yes", "no"]))
    assert out.choices[0].message.content in ("yes", "no")
    # Logprobs of the masked distribution: the allowed first tokens (prefixes of a choice)
    # hold all of it.
    first = out.choices[0].logprobs.content[0].top_logprobs
    allowed = [t for t in first if t.logprob > -9999.0]
    assert all("yes".startswith(t.token) or "no".startswith(t.token) for t in allowed)
    assert math.isclose(sum(math.exp(t.logprob) for t in allowed), 1.0, rel_tol=1e-3)
    out = chat(client, model_name, "Give me a US phone number.", temperature=0, max_tokens=20,
               extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out.choices[0].message.content)
    out = client.completions.create(model=model_name, prompt="An SQL query:", temperature=0,
                                    max_tokens=30, extra_body=structured(grammar=SQL_GRAMMAR))
    assert out.choices[0].finish_reason == "stop"
    assert SQL.fullmatch(out.choices[0].text)


def test_streaming_gives_the_non_streamed_text(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {"response_format": PERSON_FORMAT, "temperature": 0, "max_tokens": 80}
    whole = chat(client, model_name, PERSON_PROMPT, **kwargs).choices[0].message.content
    stream = chat(client, model_name, PERSON_PROMPT, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def test_n_samples_seeds_and_logprobs_all_obey(client: openai.OpenAI, model_name: str) -> None:
    regex = r"[A-Z][a-z]{2,8} (is|was) [a-z]{3,10}\."
    out = client.completions.create(
        model=model_name, prompt="A short sentence:", n=2, temperature=1.0, seed=7,
        max_tokens=30, logprobs=2, extra_body={"guided_regex": regex})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert re.fullmatch(regex, choice.text), choice.text
        assert choice.logprobs.tokens
    again = client.completions.create(
        model=model_name, prompt="A short sentence:", n=2, temperature=1.0, seed=7,
        max_tokens=30, extra_body={"guided_regex": regex})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, "response_format", "strnig"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
     "structured_outputs.json", "uniqueItems"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs.grammar",
     "EBNF"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
     "only one"),
    ({"guided_whitespace_pattern": " *", "guided_json": {"type": "object"}},
     "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, "structured_outputs.grammar",
     "Lark grammars are not accepted"),
])
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, model_name: str,
                                                   extra: dict[str, Any], param: str,
                                                   message: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, model_name, "Hi", max_tokens=4, extra_body=extra)
    error = refused.value.body
    assert error["param"] == param and message in error["message"]


def test_a_grammar_the_vocabulary_cannot_finish_is_a_400_not_an_engine_error(
        client: openai.OpenAI, model_name: str) -> None:
    """The regex compiles, and its first characters can be written, but no token of this
    model's vocabulary writes the control character \\x14 (found by the gateway fuzz test):
    the worker gives the request up as its own fault, and the client gets a 400 saying why;
    the engine goes on serving."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, model_name, "Hi", max_tokens=8, extra_body={"guided_regex": "NY\x14x"})
    assert "allows no token" in refused.value.body["message"]
    assert chat(client, model_name, "Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_a_structural_tag_response_format(client: openai.OpenAI, model_name: str) -> None:
    """vLLM's spelling, xgrammar's format: here one tag holding a JSON object."""
    tag = {"type": "tag", "begin": "<person>", "end": "</person>",
           "content": {"type": "json_schema", "json_schema": PERSON}}
    out = chat(client, model_name, PERSON_PROMPT, temperature=0, max_tokens=100,
               response_format={"type": "structural_tag", "format": tag})
    assert out.choices[0].finish_reason == "stop"
    inside = re.fullmatch(r"<person>(.*)</person>", out.choices[0].message.content, re.DOTALL)
    assert inside is not None
    jsonschema.validate(json.loads(inside.group(1)), PERSON)


def test_with_a_reasoning_parser_the_answer_validates(mesh: Mesh, model_name: str) -> None:
    """A gateway with --reasoning-parser qwen3 asks the worker to constrain only after a
    reasoning section; this model opens its output without <think>, so its whole output is
    the answer, constrained from its first token."""
    port = free_port()
    mesh.add_service("gateway-reasoning", ["--port", str(port), "--reasoning-parser", "qwen3"],
                     kind="gateway")
    try:
        poll(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 60,
             "the reasoning gateway to see the mesh")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=120) as client:
            out = chat(client, model_name, PERSON_PROMPT, response_format=PERSON_FORMAT,
                       temperature=0, max_tokens=80)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "stop"
        assert getattr(message, "reasoning_content", None) is None
        jsonschema.validate(json.loads(message.content), PERSON)
    finally:
        assert mesh.remove_service("gateway-reasoning") in (0, -15), mesh.logs()


def tokenizer_counts(mesh: Mesh) -> tuple[float, float]:
    text = mesh.services["tokenizer"].get("/metrics")[1].decode()
    return (metric_value(text, "llm_mesh:grammar_compiles_total"),
            metric_value(text, "llm_mesh:grammar_cache_hits_total"))


def test_a_resent_schema_compiles_nothing(mesh: Mesh, client: openai.OpenAI,
                                          model_name: str) -> None:
    schema = {"type": "object", "properties": {"id": {"const": uuid.uuid4().hex[:8]}},
              "required": ["id"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "id", "schema": schema}}
    before = tokenizer_counts(mesh)
    for _ in range(2):
        out = chat(client, model_name, "Any id.", response_format=response_format,
                   temperature=0, max_tokens=30)
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        compiles, hits = tokenizer_counts(mesh)
        assert compiles == before[0] + 1
    assert hits == before[1] + 1


def test_a_batch_line_with_response_format_validates(mesh: Mesh, client: openai.OpenAI,
                                                     model_name: str) -> None:
    mesh.add_service("batch", ["--job-ack-wait-s", "2"])
    try:
        line = {"custom_id": "person", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model_name, "temperature": 0, "max_tokens": 80,
                         "response_format": PERSON_FORMAT,
                         "messages": [{"role": "user", "content": PERSON_PROMPT}]}}
        uploaded = client.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_for(client, batch.id, finished)
        assert batch.status == "completed" and batch.output_file_id is not None
        result = json.loads(client.files.content(batch.output_file_id).text)
        content = result["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), PERSON)
    finally:
        assert mesh.remove_service("batch") == 0
