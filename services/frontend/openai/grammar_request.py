"""Structured outputs at the gateway: the request's constraint fields -> one GrammarSpec.

Three spellings ask for a constraint: OpenAI's `response_format` (json_object, json_schema,
and vLLM's structural_tag), vLLM's `structured_outputs` object (json, regex, choice,
grammar, json_object, structural_tag) and vLLM's older `guided_*` fields. Checked here:
which field asked, that only one did, and options the grammar engine (xgrammar) lacks (and
a Lark grammar, which is not read). The tokenizer then compiles the spec at encode time and
refuses what is malformed or cannot be enforced; either way the 400 names the field that
asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common import wire
from services.frontend.errors import invalid
from services.frontend.openai.protocol import ResponseFormat, SamplingFields

Kind = wire.GrammarKind
JSON_OBJECT_SCHEMA = '{"type":"object"}'


@dataclass(frozen=True)
class GrammarRequest:
    spec: wire.GrammarSpec
    param: str                  # the request field that asked for it, named in a 400


def grammar_request(body: SamplingFields) -> GrammarRequest | None:
    """The constraint the request asks for (None: unconstrained); 400 on a conflict."""
    _refuse_whitespace_pattern(body)
    found = _constraints(body)
    if not found:
        return None
    if len(found) > 1:
        raise invalid(f"only one structured output constraint may be set, got "
                      f"{', '.join(param for param, _ in found)}", param=found[1][0])
    param, spec = found[0]
    # NOTE: the grammar decides where the output may end; these would make the worker
    # choose between the grammar and the sampling parameters.
    if body.ignore_eos:
        raise invalid("ignore_eos cannot be combined with structured outputs: the grammar "
                      "decides where the output ends", param="ignore_eos")
    if body.min_tokens:
        raise invalid("min_tokens cannot be combined with structured outputs: the grammar "
                      "decides where the output ends", param="min_tokens")
    return GrammarRequest(spec, param)


def _constraints(body: SamplingFields) -> list[tuple[str, wire.GrammarSpec]]:
    found = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(("response_format", _response_format_spec(body.response_format)))
    options = body.structured_outputs
    if options is not None:
        for name, value in (("json", options.json_schema), ("regex", options.regex),
                            ("choice", options.choice), ("grammar", options.grammar),
                            ("json_object", options.json_object or None),
                            ("structural_tag", options.structural_tag)):
            if value is not None:
                param = f"structured_outputs.{name}"
                spec = _spec(name, value, param)
                if spec.kind == Kind.JSON_SCHEMA:
                    spec.disable_any_whitespace = options.disable_any_whitespace
                found.append((param, spec))
    for name, value in (("json", body.guided_json), ("regex", body.guided_regex),
                        ("choice", body.guided_choice), ("grammar", body.guided_grammar)):
        if value is not None:
            found.append((f"guided_{name}", _spec(name, value, f"guided_{name}")))
    return found


def _spec(name: str, value: Any, param: str) -> wire.GrammarSpec:
    if name == "json":
        return wire.GrammarSpec(kind=Kind.JSON_SCHEMA, spec=_schema_text(value))
    if name == "json_object":
        return wire.GrammarSpec(kind=Kind.JSON_SCHEMA, spec=JSON_OBJECT_SCHEMA)
    if name == "regex":
        return wire.GrammarSpec(kind=Kind.REGEX, spec=value)
    if name == "choice":
        return wire.GrammarSpec(kind=Kind.EBNF, spec=_choice_grammar(value, param))
    if name == "grammar":
        return wire.GrammarSpec(kind=Kind.EBNF, spec=_ebnf(value, param))
    return wire.GrammarSpec(kind=Kind.STRUCTURAL_TAG, spec=value)


def _response_format_spec(response_format: ResponseFormat) -> wire.GrammarSpec:
    if response_format.type == "json_object":
        return wire.GrammarSpec(kind=Kind.JSON_SCHEMA, spec=JSON_OBJECT_SCHEMA)
    if response_format.type == "structural_tag":
        return wire.GrammarSpec(kind=Kind.STRUCTURAL_TAG,
                                spec=_structural_tag_text(response_format))
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.json_schema is None:
        raise invalid("response_format of type json_schema needs json_schema.schema",
                      param="response_format")
    return wire.GrammarSpec(kind=Kind.JSON_SCHEMA, spec=_schema_text(json_schema.json_schema))


def _structural_tag_text(response_format: ResponseFormat) -> str:
    """The tag as structured_outputs.structural_tag spells it (the grammar cache reads both
    forms): xgrammar's {"type": "structural_tag", "format"}, or {"structures", "triggers"}."""
    tag_format, structures, triggers = (response_format.format, response_format.structures,
                                        response_format.triggers)
    if tag_format is not None and structures is None:
        return json.dumps({"type": "structural_tag", "format": tag_format}, ensure_ascii=False)
    if tag_format is None and structures is not None and triggers is not None:
        return json.dumps({"structures": structures, "triggers": triggers}, ensure_ascii=False)
    raise invalid("response_format of type structural_tag needs either `format` (xgrammar's "
                  "structural tag) or `structures` with `triggers`", param="response_format")


def _ebnf(grammar: str, param: str) -> str:
    # NOTE: vLLM's test for a Lark grammar: every EBNF rule has "::=", so a grammar without
    # one cannot be EBNF, and most likely is Lark ("start: ...").
    if "::=" not in grammar:
        raise invalid(f"{param} is not an EBNF grammar (it has no `::=` rule); Lark "
                      f"grammars are not accepted: write it in EBNF (GBNF-like, starting at "
                      f"`root ::= ...`)", param=param)
    return grammar


def _schema_text(schema: dict[str, Any] | str | bool) -> str:
    # NOTE: key order is kept: it is the order properties are generated in.
    if isinstance(schema, str):
        return schema
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    if not choices:
        raise invalid("choice needs at least one option", param=param)
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def _refuse_whitespace_pattern(body: SamplingFields) -> None:
    options = body.structured_outputs
    for param, value in (("structured_outputs.whitespace_pattern",
                          options.whitespace_pattern if options is not None else None),
                         ("guided_whitespace_pattern", body.guided_whitespace_pattern)):
        if value is not None:
            raise invalid(f"{param} is not supported by the grammar engine (xgrammar); set "
                          f"structured_outputs.disable_any_whitespace for compact JSON",
                          param=param)
