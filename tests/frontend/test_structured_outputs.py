"""The gateway's side of structured outputs: every spelling of a constraint becomes one
GrammarSpec, and what no grammar can give is a 400 naming the field (no engine needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from services.common import wire
from services.common.frontend.errors import ApiError
from services.common.frontend.protocol import ChatCompletionRequest, CompletionRequest
from services.common.frontend.structured_outputs import JSON_OBJECT_SCHEMA, grammar_request

Kind = wire.GrammarKind
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 **fields)


@pytest.mark.parametrize(("fields", "param", "kind", "spec"), [
    ({"response_format": {"type": "json_object"}}, "response_format", Kind.JSON_SCHEMA,
     JSON_OBJECT_SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                 "schema": SCHEMA}}},
     "response_format", Kind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":"))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "structured_outputs.json",
     Kind.JSON_SCHEMA, json.dumps(SCHEMA)),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object",
     Kind.JSON_SCHEMA, JSON_OBJECT_SCHEMA),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", Kind.REGEX, "a+"),
    ({"structured_outputs": {"choice": ["yes", 'say "no"']}}, "structured_outputs.choice",
     Kind.EBNF, 'root ::= "yes" | "say \\"no\\""'),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "structured_outputs.grammar",
     Kind.EBNF, 'root ::= "x"'),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     Kind.STRUCTURAL_TAG, "{}"),
    ({"guided_json": SCHEMA}, "guided_json", Kind.JSON_SCHEMA,
     json.dumps(SCHEMA, separators=(",", ":"))),
    ({"guided_regex": "b+"}, "guided_regex", Kind.REGEX, "b+"),
    ({"guided_choice": ["x"]}, "guided_choice", Kind.EBNF, 'root ::= "x"'),
    ({"guided_grammar": 'root ::= "y"'}, "guided_grammar", Kind.EBNF, 'root ::= "y"'),
])
def test_every_spelling_becomes_one_spec(fields: dict[str, Any], param: str,
                                         kind: wire.GrammarKind, spec: str) -> None:
    for body in (chat(**fields), CompletionRequest(model="m", prompt="x", **fields)):
        grammar = grammar_request(body)
        assert grammar is not None
        assert (grammar.param, grammar.spec.kind, grammar.spec.spec) == (param, kind, spec)


def test_no_constraint_and_text_ask_for_nothing() -> None:
    assert grammar_request(chat()) is None
    assert grammar_request(chat(response_format={"type": "text"})) is None
    assert grammar_request(chat(structured_outputs={"json_object": False})) is None


def test_compact_json_only_where_asked() -> None:
    options = {"json": SCHEMA, "disable_any_whitespace": True}
    grammar = grammar_request(chat(structured_outputs=options))
    assert grammar is not None and grammar.spec.disable_any_whitespace
    grammar = grammar_request(chat(structured_outputs={"regex": "a",
                                                       "disable_any_whitespace": True}))
    assert grammar is not None and not grammar.spec.disable_any_whitespace


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a", "min_tokens": 3}, "min_tokens"),
])
def test_what_no_grammar_can_give_is_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        grammar_request(chat(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)


def test_unknown_options_and_formats_are_refused_but_vllm_no_ops_pass() -> None:
    with pytest.raises(ValidationError):
        chat(structured_outputs={"regexp": "a"})          # a misspelt constraint
    with pytest.raises(ValidationError):
        chat(response_format={"type": "yaml"})
    grammar = grammar_request(chat(structured_outputs={
        "regex": "a", "disable_fallback": True, "disable_additional_properties": True}))
    assert grammar is not None and grammar.spec.spec == "a"
