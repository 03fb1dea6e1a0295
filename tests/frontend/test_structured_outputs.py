"""The gateway's side of structured outputs: every spelling of a constraint becomes one
GrammarSpec, and what no grammar can give is a 400 naming the field (no engine needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import ValidationError
from transformers import AutoTokenizer

from services.common import wire
from services.common.grammar.grammar_cache import GrammarCache, tokenizer_info
from services.common.model_files import resolve_model
from services.frontend.errors import ApiError
from services.frontend.openai.grammar_request import JSON_OBJECT_SCHEMA, grammar_request
from services.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest

Kind = wire.GrammarKind
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
# A structural tag, both of vLLM's spellings: xgrammar's format, and structures + triggers.
TAG_FORMAT = {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
    {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA},
     "end": "</f>"}]}
TAG_STRUCTURES = [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]


@pytest.fixture(scope="module")
def embedded_tokenizer_info() -> xgr.TokenizerInfo:
    return tokenizer_info(AutoTokenizer.from_pretrained(resolve_model("").hf_dir))


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
    ({"response_format": {"type": "structural_tag", "format": TAG_FORMAT}}, "response_format",
     Kind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": TAG_FORMAT})),
    ({"response_format": {"type": "structural_tag", "structures": TAG_STRUCTURES,
                          "triggers": ["<f>"]}}, "response_format", Kind.STRUCTURAL_TAG,
     json.dumps({"structures": TAG_STRUCTURES, "triggers": ["<f>"]})),
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
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": TAG_STRUCTURES}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "format": TAG_FORMAT,
                          "structures": TAG_STRUCTURES, "triggers": ["<f>"]}},
     "response_format"),
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


@pytest.mark.parametrize("param", ["structured_outputs.grammar", "guided_grammar"])
def test_a_lark_grammar_is_a_400_that_says_so(param: str) -> None:
    lark = '?start: answer\nanswer: "yes" | "no"'
    fields = ({"structured_outputs": {"grammar": lark}} if param != "guided_grammar"
              else {"guided_grammar": lark})
    with pytest.raises(ApiError) as refused:
        grammar_request(chat(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert "Lark" in refused.value.message and "root ::=" in refused.value.message


@pytest.mark.parametrize("response_format", [
    {"type": "structural_tag", "format": TAG_FORMAT},
    {"type": "structural_tag", "structures": TAG_STRUCTURES, "triggers": ["<f>"]},
], ids=["format", "structures"])
def test_a_structural_tag_response_format_is_enforced(response_format: dict[str, Any],
                                                      embedded_tokenizer_info: object) -> None:
    """Compiled as the tokenizer and the worker do (real xgrammar, the embedded vocabulary):
    free text until the trigger, then the tag's schema inside it."""
    grammar = grammar_request(chat(response_format=response_format))
    assert grammar is not None
    cache = GrammarCache(lambda: embedded_tokenizer_info, 2)
    try:
        compiled = cache.get(grammar.spec).result()
    finally:
        cache.close()
    accepts = xgr.GrammarMatcher(compiled).accept_string
    assert accepts('I will call it. <f>{"b": 1, "a": "x"}</f>')
    assert not xgr.GrammarMatcher(compiled).accept_string('<f>{"b": "one"}</f>')
