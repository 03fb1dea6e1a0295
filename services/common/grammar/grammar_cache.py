"""Compiled grammars for one vocabulary: a bounded LRU of compile futures, compiled on a small
thread pool so neither the tokenizer's event loop nor the worker's step thread compiles."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from services.common import wire
from services.common.grammar.spec_check import GrammarError, check_spec
from services.common.metrics import GrammarMetrics

GrammarKey = tuple[int, str, bool]   # (kind, spec text, disable_any_whitespace)

# xgrammar's messages start with a timestamp, a C++ source location and the failed check.
_XGRAMMAR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCache:
    def __init__(self, load_tokenizer_info: Callable[[], xgr.TokenizerInfo], max_entries: int,
                 max_threads: int = 1, metrics: GrammarMetrics | None = None) -> None:
        """`load_tokenizer_info` runs once, in a compile thread, before the first compile."""
        self._load_tokenizer_info = load_tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._max_entries = max_entries
        self._entries: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._metrics = metrics

    def get(self, spec: wire.GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, compiled once. A failed compile stays cached too
        (its future raises GrammarError), so a bad spec sent again costs nothing."""
        key = (int(spec.kind), spec.spec, spec.disable_any_whitespace)
        with self._lock:
            future = self._entries.get(key)
            is_hit = future is not None
            if is_hit:
                self._entries.move_to_end(key)
            else:
                future = self._pool.submit(self._compile, key)
                self._entries[key] = future
                if len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
        if self._metrics is not None:
            (self._metrics.cache_hits if is_hit else self._metrics.compiles).inc()
        return future

    def warm(self) -> None:
        """Builds the compiler (xgrammar's tokenizer info: ~1 s) now, in the compile thread,
        so the first request with a grammar does not wait for it."""
        self._pool.submit(self._get_compiler)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, text, disable_any_whitespace = key
        spec = wire.GrammarSpec(kind=wire.GrammarKind(kind), spec=text,
                                disable_any_whitespace=disable_any_whitespace)
        check_spec(spec)
        started = time.perf_counter()
        try:
            grammar = _compile_with(self._get_compiler(), spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_XGRAMMAR_NOISE.sub("", str(exc)).strip()) from None
        if not _allows_a_first_token(grammar):
            raise GrammarError("the grammar matches no output at all")
        if self._metrics is not None:
            self._metrics.compile_time.observe(time.perf_counter() - started)
        return grammar

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                # NOTE: xgrammar's own cache is unbounded: ours is the one that holds grammars.
                self._compiler = xgr.GrammarCompiler(self._load_tokenizer_info(), max_threads=1,
                                                     cache_enabled=False)
            return self._compiler


def _compile_with(compiler: xgr.GrammarCompiler, spec: wire.GrammarSpec) -> xgr.CompiledGrammar:
    kind = spec.kind
    if kind == wire.GrammarKind.JSON_SCHEMA:
        return compiler.compile_json_schema(spec.spec,
                                            any_whitespace=not spec.disable_any_whitespace)
    if kind == wire.GrammarKind.REGEX:
        return compiler.compile_regex(spec.spec)
    if kind == wire.GrammarKind.EBNF:
        return compiler.compile_grammar(spec.spec)
    if kind == wire.GrammarKind.STRUCTURAL_TAG:
        return compiler.compile_structural_tag(*_structural_tag_args(spec.spec))
    raise GrammarError(f"unknown grammar kind {kind}")


def _allows_a_first_token(grammar: xgr.CompiledGrammar) -> bool:
    bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _structural_tag_args(text: str) -> tuple[Any, ...]:
    """vLLM's two spellings: the legacy {"structures": [{begin, schema, end}], "triggers"}, or
    xgrammar's structural tag (a {"type": "structural_tag", "format": ...} JSON string)."""
    tag = json.loads(text)
    if not (isinstance(tag, dict) and "structures" in tag):
        return (text,)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                       end=s["end"]) for s in tag["structures"]]
        return items, list(tag["triggers"])
    except (KeyError, TypeError):
        raise GrammarError("a structural tag with `structures` needs a list of {begin, "
                           "schema, end} objects and a list of `triggers`") from None


def tokenizer_info(hf_tokenizer: object, vocab_size: int | None = None,
                   stop_token_ids: list[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of a HF tokenizer: the vocabulary padded to the model's logits width,
    and the tokens that end a grammar (the model's EOS ids)."""
    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids)
