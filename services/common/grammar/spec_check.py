"""Checks on a grammar spec before it is compiled: bounds that refuse hostile specs, and the
JSON-schema keywords xgrammar compiles but does not enforce (an output could break them, so
they are refused rather than silently loosened)."""

from __future__ import annotations

import json
from typing import Any

from services.common import wire
from services.common.json_depth import nesting_depth

MAX_SPEC_BYTES = 64 * 1024
MAX_NESTING_DEPTH = 64

# NOTE: measured on xgrammar 0.2.9 by compiling a schema with the keyword and feeding the
# matcher an instance that breaks it (tests/tokenizer/test_grammar_checks.py keeps it true).
_UNENFORCED_KEYWORDS = frozenset({
    "contains", "minContains", "maxContains", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef"})
# Standard formats xgrammar lets anything through for (unknown formats are annotations).
_UNENFORCED_FORMATS = frozenset({"iri", "iri-reference", "idn-email", "idn-hostname", "regex"})
# Where subschemas sit, so property names ("not", "if") are never taken for keywords.
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames",
              "additionalItems", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


class GrammarError(ValueError):
    """A grammar that cannot be compiled or enforced: the client's fault (a 400)."""


def check_spec(spec: wire.GrammarSpec) -> None:
    """Raises GrammarError for a spec too large, nested too deeply or asking for what the
    grammar engine cannot enforce. Syntax errors are left to the compiler."""
    size = len(spec.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise GrammarError(f"the grammar is {size} bytes; at most {MAX_SPEC_BYTES} are "
                           f"accepted")
    if spec.kind == wire.GrammarKind.JSON_SCHEMA:
        check_json_schema(_load_json(spec.spec, "JSON schema"))
    elif spec.kind == wire.GrammarKind.STRUCTURAL_TAG:
        for schema in _embedded_schemas(_load_json(spec.spec, "structural tag")):
            check_json_schema(schema)


def _load_json(text: str, what: str) -> Any:
    try:
        value = json.loads(text)
    except RecursionError:
        raise GrammarError(f"the {what} is nested more than {MAX_NESTING_DEPTH} levels "
                           f"deep") from None
    except ValueError as exc:
        raise GrammarError(f"the {what} is not valid JSON: {exc}") from None
    if nesting_depth(value) > MAX_NESTING_DEPTH:
        raise GrammarError(f"the {what} is nested more than {MAX_NESTING_DEPTH} levels deep")
    return value


def check_json_schema(schema: Any) -> None:
    """Raises GrammarError naming the first keyword (as a JSON pointer) xgrammar would not
    enforce. Malformed schemas pass: the compiler's message says what is wrong."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _unenforced(node)
        if problem is not None:
            raise GrammarError(f"the JSON schema uses {problem} at {path}, which structured "
                               f"outputs cannot enforce during generation; remove it")
        stack.extend((node[key], f"{path}/{key}") for key in _SUBSCHEMA if key in node)
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{path}/{key}/{_pointer_escape(name)}")
                             for name, sub in node[key].items())


def _unenforced(node: dict[str, Any]) -> str | None:
    """The first keyword of one schema object that xgrammar would not enforce, described."""
    unenforced = sorted(_UNENFORCED_KEYWORDS.intersection(node))
    if unenforced:
        return f"'{unenforced[0]}'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema"
    # NOTE: xgrammar takes oneOf as anyOf; a discriminator makes the branches exclusive.
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 \
            and "discriminator" not in node:
        return "'oneOf' without a discriminator (use anyOf)"
    multiple = node.get("multipleOf")
    if multiple is not None and not (node.get("type") == "integer" and isinstance(multiple, int)):
        return "'multipleOf' (enforced only on integers, by an integer)"
    if node.get("format") in _UNENFORCED_FORMATS:
        return f"format '{node['format']}'"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"the remote reference '{ref}'"
    return None


def _embedded_schemas(tag: Any) -> list[Any]:
    """JSON schemas inside a structural tag: `schema` of a legacy structure, `json_schema` of
    a json_schema content item."""
    found, stack = [], [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key in ("schema", "json_schema"):
                if key in node:
                    found.append(node[key])
            stack.extend(v for k, v in node.items() if k not in ("schema", "json_schema"))
    return found


def _pointer_escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
