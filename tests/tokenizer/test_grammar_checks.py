"""The checks before a grammar compiles: hostile sizes and depths, and the JSON-schema keywords
xgrammar compiles without enforcing — refused, and still loose in xgrammar (when a new
xgrammar enforces one, the last test says so and the refusal can go)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common import wire
from services.common.grammar.spec_check import (
    MAX_NESTING_DEPTH,
    MAX_SPEC_BYTES,
    GrammarError,
    check_spec,
)
from tests.bench.tiny_tokenizer import save_tiny_tokenizer

INT = {"type": "integer"}
INTS = {"type": "array", "items": INT}
# (schema with a keyword xgrammar does not enforce, an instance that breaks it)
UNENFORCED: dict[str, tuple[dict[str, Any], str]] = {
    "uniqueItems": ({**INTS, "uniqueItems": True}, "[1,1]"),
    "contains": ({**INTS, "contains": {"const": 1}}, "[2]"),
    "not": ({"not": {"type": "string"}}, '"a"'),
    "if": ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"a"'),
    "dependentRequired": ({"type": "object", "properties": {"a": INT, "b": INT},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    "allOf": ({"allOf": [INT, {"minimum": 2}]}, "1"),
    "oneOf": ({"oneOf": [INT, {"type": "number"}]}, "1"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3"),
    "format 'iri'": ({"type": "string", "format": "iri"}, '"a b"'),
    "remote reference": ({"$ref": "https://example.com/int.json"}, '"a"'),
}


def json_spec(schema: Any) -> wire.GrammarSpec:
    return wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA, spec=json.dumps(schema))


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = INT
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("keyword", list(UNENFORCED))
def test_unenforced_keywords_are_refused_with_where_they_are(keyword: str) -> None:
    schema, _ = UNENFORCED[keyword]
    wrapped = {"type": "object", "properties": {"inner": schema}}
    with pytest.raises(GrammarError, match="#/properties/inner") as refused:
        check_spec(json_spec(wrapped))
    assert keyword.split()[-1] in str(refused.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": INT, "if": INT, "contains": INT}},  # names
    {"allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": INT}},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}}],
     "discriminator": {"propertyName": "kind"}},
    {"type": "integer", "multipleOf": 3},
    {"type": "string", "format": "email"},
    {"type": "array", "items": INT, "minItems": 1, "uniqueItems": False},
    nested(MAX_NESTING_DEPTH // 2),
])
def test_what_xgrammar_enforces_passes(schema: dict[str, Any]) -> None:
    check_spec(json_spec(schema))


def test_hostile_specs_are_refused_before_compiling() -> None:
    with pytest.raises(GrammarError, match="nested more than 64 levels"):
        check_spec(json_spec(nested(MAX_NESTING_DEPTH + 1)))
    with pytest.raises(GrammarError, match="nested more than 64 levels"):
        check_spec(wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA,
                                    spec="[" * 5000 + "]" * 5000))
    with pytest.raises(GrammarError, match=f"at most {MAX_SPEC_BYTES}"):
        check_spec(wire.GrammarSpec(kind=wire.GrammarKind.REGEX, spec="a" * (MAX_SPEC_BYTES + 1)))
    with pytest.raises(GrammarError, match="not valid JSON"):
        check_spec(wire.GrammarSpec(kind=wire.GrammarKind.JSON_SCHEMA, spec='{"type": '))


def test_schemas_inside_structural_tags_are_checked() -> None:
    tag = {"type": "structural_tag", "triggers": ["<f>"], "structures": [
        {"begin": "<f>", "schema": {"not": INT}, "end": "</f>"}]}
    with pytest.raises(GrammarError, match="'not'"):
        check_spec(wire.GrammarSpec(kind=wire.GrammarKind.STRUCTURAL_TAG, spec=json.dumps(tag)))


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> xgr.GrammarCompiler:
    directory = save_tiny_tokenizer(Path(tmp_path_factory.mktemp("tokenizer")))
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(directory))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@pytest.mark.parametrize("keyword", list(UNENFORCED))
def test_the_refused_keywords_are_still_loose_in_xgrammar(compiler: xgr.GrammarCompiler,
                                                          keyword: str) -> None:
    schema, breaking = UNENFORCED[keyword]
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    assert matcher.accept_string(breaking) and matcher.is_completed(), (
        f"xgrammar now enforces {keyword}: stop refusing it in spec_check.py")
