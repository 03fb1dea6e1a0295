"""Which engine serves a request (issue 15): by what each engine holds in its KV cache,
with conversations kept on the engine that holds them.

Modes (`--router-mode`):
  kv             the KV router: each prompt's block hashes are looked up in a prefix index,
                 and the engine with the lowest cost (services/frontend/router/cost.py: prefill
                 blocks it would not have to compute, against its load) wins. An engine whose
                 scheduler publishes KV events (`--enable-kv-events`) is known by what it
                 holds, replayed from the durable JetStream stream on start; one that does
                 not is predicted from this router's own decisions, for `--router-ttl-s`.
  least-loaded   the fewest running + waiting + in-flight requests.
  round-robin    each engine in turn.

Sessions (kv mode; the other two are the plain baselines): a request naming a session (the
`prompt_cache_key` body field, OpenAI's name, or an `x-session-id` header) goes where its
session went last, unless that engine is past `--router-session-busy-threshold` of its KV
cache, or is queueing and holds at most half of the session's last prompt, and another has
room (under the threshold, nothing queued): it then spills to the router's choice among
those, which becomes the session's engine. A new session's choice also counts, on each
engine, the histories of the live sessions it holds (session_table.py), so conversations
spread by the KV they will need.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from services.common.block_hash import BlockHasher, MultiModalSpan
from services.common.metrics import RouterMetrics
from services.frontend.engine_client.mesh_view import EngineView, least_loaded
from services.frontend.router import ApproximateIndex, EngineLoad, PrefixIndex, RoutingCost
from services.frontend.router.session_table import SessionTable

# What a prompt's block hashes mix in beside its tokens: cache salt, LoRA id, image spans.
PrefixKey = tuple[str, int, tuple[MultiModalSpan, ...]]
# A released request's blocks leave the engine's load at its first heartbeat made after the
# release, by the scheduler's clock; past this age they leave anyway, so a scheduler whose
# clock runs behind the gateway's cannot keep its load undercounted for long.
RELEASE_MAX_AGE_S = 3.0


class RouterMode(str, Enum):
    KV = "kv"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class _Release:
    """A request of this router that ended on an engine, at `at` (this router's wall clock)."""
    at: float
    num_blocks: int           # all it held: prompt and output
    num_prompt_blocks: int    # what a report made while it waited counted as prefill to do


@dataclass
class Route:
    """One routing decision, kept by the request until its prefill is done."""
    engine: EngineView
    reason: str                        # kv_overlap, least_loaded, round_robin, session, ...
    num_predicted_cached_tokens: int = 0
    num_pending_blocks: int = 0        # counted on the engine until the first token
    num_prompt_blocks: int = 0
    block_size: int = 16
    history_probe: bytes = b""         # the prompt's middle block (SessionTable.bind)
    settled: bool = field(default=False, repr=False)
    released: bool = field(default=False, repr=False)


class EngineRouter:
    def __init__(self, mode: RouterMode, index: PrefixIndex, approximate: ApproximateIndex,
                 sessions: SessionTable, *, overlap_weight: float = 1.0,
                 temperature: float = 0.0, session_busy_threshold: float = 0.9,
                 session_history_weight: float = 1.0,
                 hash_algo: str = "sha256", metrics: RouterMetrics | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.mode = mode
        self._overlap_weight = overlap_weight
        self._temperature = temperature
        self.index = index                  # publisher (scheduler instance) -> its blocks
        self.approximate = approximate      # engine id -> blocks routed to it
        self.sessions = sessions
        self._busy_threshold = session_busy_threshold
        if session_history_weight < 0:
            raise ValueError("the session history weight must be >= 0")
        self._history_weight = session_history_weight
        self._hash_algo = hash_algo
        self._hashers: dict[int, BlockHasher] = {}     # by block size, as engines report it
        self._costs: dict[int, RoutingCost] = {}
        self._pending_blocks: dict[str, int] = {}    # engine id -> prompts not yet prefilled
        # engine id -> this router's requests that ended after the engine's last heartbeat
        # was made, which still counts them, running or waiting (a turn that follows at once
        # would see the engine it just left as busy).
        self._releases: dict[str, list[_Release]] = {}
        self._wall_clock = wall_clock
        self._turn = itertools.count()
        self._metrics = metrics

    def route(self, engines: Sequence[EngineView], token_ids: np.ndarray, cache_salt: str = "",
              session_id: str = "", lora_id: int = 0,
              mm_spans: tuple[MultiModalSpan, ...] = ()) -> Route:
        """Picks one of `engines` (non-empty: the ready candidates) for a prompt; the
        prompt's blocks are hashed as the engines hash them (salt and LoRA adapter)."""
        route = self._choose(engines, token_ids, (cache_salt, lora_id, mm_spans), session_id)
        if session_id and self.mode is RouterMode.KV:
            self.sessions.bind(session_id, route.engine.engine_id, route.num_prompt_blocks,
                               route.history_probe)
        engine_id = route.engine.engine_id
        self._pending_blocks[engine_id] = (self._pending_blocks.get(engine_id, 0)
                                           + route.num_pending_blocks)
        if self._metrics is not None:
            self._metrics.decisions.labels(route.reason).inc()
            self._metrics.predicted_cached_tokens.inc(route.num_predicted_cached_tokens)
            self._metrics.index_blocks.set(self.index.num_blocks + self.approximate.num_blocks)
            self._metrics.sessions.set(len(self.sessions))
        return route

    def settle(self, route: Route) -> None:
        """The request's prefill is over (its first token came, or it ended): its blocks are
        the engine's own load from now on, as its heartbeats say."""
        if route.settled:
            return
        route.settled = True
        engine_id = route.engine.engine_id
        left = self._pending_blocks.get(engine_id, 0) - route.num_pending_blocks
        if left > 0:
            self._pending_blocks[engine_id] = left
        else:
            self._pending_blocks.pop(engine_id, None)

    def release(self, route: Route, num_output_tokens: int, ended_on: str = "") -> None:
        """The request ended on engine `ended_on` (default: the routed one; a request moved
        off its queue ends elsewhere): its blocks leave that engine's load before its
        heartbeat says."""
        self.settle(route)
        if route.released:
            return
        route.released = True
        num_blocks = route.num_prompt_blocks + math.ceil(num_output_tokens / route.block_size)
        self._releases.setdefault(ended_on or route.engine.engine_id, []).append(
            _Release(self._wall_clock(), num_blocks, route.num_prompt_blocks))

    def on_engine_heartbeat(self, engine_id: str, made_at: float) -> None:
        """A fresh load report, made at `made_at` (the scheduler's wall clock): what ended
        before it no longer counts in it. A report made before a release, though it arrives
        after (heartbeats come straight from the scheduler, a finish through the tokenizer),
        still counts that request."""
        releases = self._releases.get(engine_id)
        if releases is None:
            return
        oldest = self._wall_clock() - RELEASE_MAX_AGE_S
        releases[:] = [r for r in releases if r.at > made_at and r.at > oldest]
        if not releases:
            del self._releases[engine_id]

    def observe_cached(self, num_cached_tokens: int) -> None:
        """What the engine actually found cached, beside what the router predicted."""
        if self._metrics is not None:
            self._metrics.actual_cached_tokens.inc(num_cached_tokens)

    def _choose(self, engines: Sequence[EngineView], token_ids: np.ndarray,
                prefix_key: PrefixKey, session_id: str) -> Route:
        if session_id and self.mode is RouterMode.KV:
            engine_id = self.sessions.get(session_id)
            held = next((e for e in engines if e.engine_id == engine_id), None)
            if held is None:   # a new session, or its engine is gone
                return self._kv_route(engines, token_ids, prefix_key, new_session=True)
            # It spills only to an engine with room (under the threshold, nothing queued):
            # one as busy would cost the session its history and gain it nothing (measured:
            # turns spilled to a queueing engine waited 7.5 s there and recomputed 3k tokens
            # of history, docs/benchmarks.md 11k).
            others = [e for e in engines
                      if e is not held and e.has_room(self._busy_threshold)]
            if not others or not self._should_leave(held, session_id):
                return self._kv_route(engines, token_ids, prefix_key, only=held,
                                      reason="session")
            if self._metrics is not None:
                self._metrics.session_spills.inc()
            route = self._kv_route(others, token_ids, prefix_key, new_session=True)
            route.reason = "session_spill"
            return route
        if self.mode is RouterMode.ROUND_ROBIN:
            ordered = sorted(engines, key=lambda e: e.engine_id)
            return Route(ordered[next(self._turn) % len(ordered)], "round_robin")
        if self.mode is RouterMode.LEAST_LOADED:
            return Route(least_loaded(engines), "least_loaded")
        return self._kv_route(engines, token_ids, prefix_key)

    def _kv_route(self, engines: Sequence[EngineView], token_ids: np.ndarray,
                  prefix_key: PrefixKey, only: EngineView | None = None,
                  reason: str = "", new_session: bool = False) -> Route:
        block_size = engines[0].block_size
        hashes = self._hasher(block_size).hash_blocks(token_ids, *prefix_key)
        overlaps = self._overlaps(engines, hashes)
        num_prompt_blocks = math.ceil(len(token_ids) / block_size)
        if only is not None:
            chosen, num_overlap = only, overlaps.get(only.engine_id, 0)
        else:
            if new_session:
                engines = self._least_busy_with_sessions(engines)
            decision = self._cost(block_size).choose(
                num_prompt_blocks, {e.engine_id: self._load(e, new_session) for e in engines},
                overlaps)
            chosen = next(e for e in engines if e.engine_id == decision.engine_id)
            num_overlap, reason = overlaps.get(chosen.engine_id, 0), decision.reason.value
        if not self.index.knows(chosen.scheduler_id):
            self.approximate.record(chosen.engine_id, hashes)
        return Route(chosen, reason, num_overlap * block_size,
                     num_prompt_blocks - num_overlap, num_prompt_blocks, block_size,
                     hashes[len(hashes) // 2] if hashes else b"")

    def _should_leave(self, held: EngineView, session_id: str) -> bool:
        """The session's engine is past the busy threshold, or queueing and no longer
        holding the middle block of the session's last prompt: at most half of that history
        is left there, not worth the wait (measured: such turns queued 3-10 s to recompute
        it while the other engine idled, docs/benchmarks.md 11k)."""
        if held.kv_cache_usage >= self._busy_threshold:
            return True
        if held.can_start_another:
            return False
        probe = self.sessions.probe(session_id)
        return bool(probe) and not self._overlaps([held], [probe])[held.engine_id]

    def _least_busy_with_sessions(self, engines: Sequence[EngineView]) -> list[EngineView]:
        """Where a new session may go: of the engines under the busy threshold, those serving
        the fewest live sessions per KV block. Its later turns stick to the engine, so the
        split of sessions sets the engines' load for their whole length; the moment's load
        and cache (the cost) only choose among these (measured: placed by cost alone, five
        of eight agents landed on one engine of two, docs/benchmarks.md 11e)."""
        open_ = [e for e in engines if e.kv_cache_usage < self._busy_threshold] or engines
        share = {e.engine_id: self.sessions.num_sessions_on(e.engine_id) / max(e.num_blocks, 1)
                 for e in open_}
        fewest = min(share.values())
        return [e for e in open_ if share[e.engine_id] == fewest]

    def cached_tokens(self, engines: Sequence[EngineView], token_ids: np.ndarray,
                      cache_salt: str = "", lora_id: int = 0,
                      mm_spans: tuple[MultiModalSpan, ...] = ()) -> dict[str, int]:
        """Engine id -> leading prompt tokens it holds, as routing counts them (KV events, or
        this router's predictions): what the prompt would not prefill there."""
        if not engines:
            return {}
        block_size = engines[0].block_size
        hashes = self._hasher(block_size).hash_blocks(token_ids, cache_salt, lora_id, mm_spans)
        return {engine_id: num_blocks * block_size
                for engine_id, num_blocks in self._overlaps(engines, hashes).items()}

    def _overlaps(self, engines: Sequence[EngineView], hashes: list[bytes]) -> dict[str, int]:
        """Engine id -> leading blocks held: from KV events where its scheduler publishes
        them, else from this router's predictions."""
        published = self.index.overlaps(hashes) if hashes else {}
        predicted = self.approximate.overlaps(hashes) if hashes else {}
        return {e.engine_id: (published.get(e.scheduler_id, 0)
                              if self.index.knows(e.scheduler_id)
                              else predicted.get(e.engine_id, 0)) for e in engines}

    def _load(self, engine: EngineView, new_session: bool = False) -> EngineLoad:
        block_size = max(engine.block_size, 1)
        num_cached = (self.index.num_blocks_of(engine.scheduler_id)
                      if self.index.knows(engine.scheduler_id)
                      else self.approximate.num_blocks_of(engine.engine_id))
        reported_active = round(engine.kv_cache_usage * engine.num_blocks)
        reported_pending = math.ceil((engine.num_waiting_tokens
                                      + engine.num_running_prefill_tokens) / block_size)
        # NOTE: a report made before a request ended counted it as running (its blocks) or,
        # if the whole request took less than a heartbeat, as waiting (its prompt): neither
        # counts once it ended.
        releases = self._releases.get(engine.engine_id, ())
        return EngineLoad(
            num_active_blocks=max(0, reported_active - sum(r.num_blocks for r in releases)),
            num_pending_prefill_blocks=(
                max(0, reported_pending - sum(r.num_prompt_blocks for r in releases))
                + self._pending_blocks.get(engine.engine_id, 0)),
            num_cached_blocks=num_cached,
            num_session_blocks=(round(self._history_weight
                                      * self.sessions.num_blocks_on(engine.engine_id))
                                if new_session else 0))

    def _cost(self, block_size: int) -> RoutingCost:
        cost = self._costs.get(block_size)
        if cost is None:
            cost = self._costs[block_size] = RoutingCost(block_size, self._overlap_weight,
                                                         self._temperature)
        return cost

    def _hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size, self._hash_algo)
        return hasher
