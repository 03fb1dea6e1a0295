"""The tokenizer's grammar validation: xgrammar's errors as clean 400 messages, one compile per
spec (failures included), counted in the service's metrics, and bounded in time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from services.common import wire
from services.common.grammar.grammar_cache import tokenizer_info
from services.tokenizer.grammar_validator import GrammarValidator
from tests.bench.tiny_tokenizer import save_tiny_tokenizer

Kind = wire.GrammarKind


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    return AutoTokenizer.from_pretrained(save_tiny_tokenizer(Path(tmp_path_factory.mktemp("t"))))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def validator(hf_tokenizer: object, registry: CollectorRegistry) -> Iterator[GrammarValidator]:
    validator = GrammarValidator(lambda: tokenizer_info(hf_tokenizer), registry,
                                 max_entries=2, timeout_s=30.0)
    yield validator
    validator.close()


def counts(registry: CollectorRegistry) -> tuple[float | None, float | None]:
    return (registry.get_sample_value("llm_mesh:grammar_compiles_total"),
            registry.get_sample_value("llm_mesh:grammar_cache_hits_total"))


@pytest.mark.parametrize(("kind", "spec", "message"), [
    (Kind.JSON_SCHEMA, '{"type": "strnig"}', 'Unsupported type "strnig"'),
    (Kind.REGEX, "a(b", "parenthesis is not closed"),
    (Kind.EBNF, 'root ::= "a" |', "EBNF parser error"),
    (Kind.EBNF, 'start ::= "a"', 'root rule with name "root" is not found'),
    (Kind.STRUCTURAL_TAG, '{"type": "structural_tag", "format": {"type": "nope"}}',
     "Format type not recognized"),
    (Kind.EBNF, r'root ::= [^\x00-\U0010FFFF]', "matches no output at all"),
])
async def test_bad_grammars_get_xgrammars_reason_without_its_noise(
        validator: GrammarValidator, kind: wire.GrammarKind, spec: str, message: str) -> None:
    error = await validator.error_of(wire.GrammarSpec(kind=kind, spec=spec))
    assert error is not None and message in error
    assert ".cc:" not in error and "Check failed" not in error


async def test_each_spec_compiles_once_and_the_lru_is_bounded(
        validator: GrammarValidator, registry: CollectorRegistry) -> None:
    good = wire.GrammarSpec(kind=Kind.REGEX, spec="(w[0-9]+)+")   # the tiny vocabulary
    bad = wire.GrammarSpec(kind=Kind.REGEX, spec="(")
    assert await validator.error_of(good) is None
    assert await validator.error_of(good) is None
    first = await validator.error_of(bad)
    assert first is not None and await validator.error_of(bad) == first
    assert counts(registry) == (2.0, 2.0)
    # Whitespace freedom is part of the key; a third spec evicts the oldest (max_entries=2).
    assert await validator.error_of(wire.GrammarSpec(kind=Kind.REGEX, spec="(",
                                                     disable_any_whitespace=True)) == first
    assert await validator.error_of(good) is None
    assert counts(registry) == (4.0, 2.0)


async def test_a_compile_past_the_timeout_is_refused(hf_tokenizer: object) -> None:
    release = threading.Event()

    def slow_tokenizer_info() -> object:
        release.wait(30)
        return tokenizer_info(hf_tokenizer)

    registry = CollectorRegistry()
    validator = GrammarValidator(slow_tokenizer_info, registry, 4, timeout_s=0.05)
    spec = wire.GrammarSpec(kind=Kind.REGEX, spec="w1")
    assert await validator.error_of(spec) == "the grammar did not compile within 0.05 s"
    release.set()
    validator.timeout_s = 30.0
    assert await validator.error_of(spec) is None   # the shared compile was not cancelled
    assert counts(registry) == (1.0, 1.0)
    validator.close()
