"""Structured outputs at encode time: compile the request's grammar against this model's
vocabulary, so a bad or hostile one is a 400 before any engine sees it. Compiles are cached
(an agent re-sending the same schema compiles once) and bounded in time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import xgrammar as xgr
from prometheus_client import CollectorRegistry

from services.common import wire
from services.common.grammar.grammar_cache import GrammarCache
from services.common.grammar.spec_check import GrammarError
from services.common.metrics import GrammarMetrics

# NOTE: a compile cannot be stopped once it runs; two threads keep one slow grammar from
# holding up every other request's while it times out.
COMPILE_THREADS = 2


class GrammarValidator:
    def __init__(self, load_tokenizer_info: Callable[[], xgr.TokenizerInfo],
                 registry: CollectorRegistry, max_entries: int, timeout_s: float) -> None:
        self._cache = GrammarCache(load_tokenizer_info, max_entries, COMPILE_THREADS,
                                   GrammarMetrics(registry))
        self.timeout_s = timeout_s
        self._cache.warm()

    async def error_of(self, spec: wire.GrammarSpec) -> str | None:
        """Why `spec` cannot be enforced, or None when it compiled."""
        future = asyncio.wrap_future(self._cache.get(spec))
        try:
            # NOTE: shielded: a timed-out wait must not cancel the compile other requests share.
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            future.add_done_callback(_retrieve)   # nobody awaits it any more: no warning
            return f"the grammar did not compile within {self.timeout_s:g} s"
        except GrammarError as exc:
            return str(exc)
        return None

    def close(self) -> None:
        self._cache.close()


def _retrieve(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()
