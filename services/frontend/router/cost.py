"""The KV router's choice of engine, after Dynamo's DefaultWorkerSelector.

For each candidate engine e, in blocks (lower is better):

    logit(e)          = overlap_weight × prefill_blocks(e) + decode_blocks(e)
    prefill_blocks(e) = prompt blocks − leading prompt blocks e holds + e's pending prefill
    decode_blocks(e)  = e's active KV blocks (+ its live sessions' histories, weighted, when
                        placing a new session: the KV they will come back for)

The weight trades time to first token (prefill avoided) against the load on each engine
(decode slowed). Temperature 0 takes the lowest logit, ties going to the least loaded engine
and then the lowest id, so a replay routes the same. Above 0 it samples from
softmax(−normalized logit / temperature), the logits scaled to [0, 1] by their range so a
temperature means the same whatever the prompt length or the cluster's load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class RouteReason(str, Enum):
    KV_OVERLAP = "kv_overlap"        # the chosen engine holds leading blocks of the prompt
    LEAST_LOADED = "least_loaded"    # it holds none: a cold prompt, or load beat the cache


class NoEngineError(LookupError):
    """No candidate engine to route to."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports (or the router counts) of its current work, in KV blocks."""

    num_active_blocks: int = 0            # held by running requests: the decode load
    num_pending_prefill_blocks: int = 0   # prompts queued or part-way through prefill
    # Blocks in its prefix cache: of engines otherwise tied, the emptiest cache takes a
    # cold prompt, so idle engines' caches fill evenly instead of the first one's.
    num_cached_blocks: int = 0
    # Placing a new conversation: the histories of those the engine already serves.
    num_session_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return self.num_active_blocks + self.num_pending_prefill_blocks


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    engine_id: str
    reason: RouteReason
    num_predicted_cached_tokens: int
    engine_to_logit: dict[str, float]   # every candidate's cost, for logs and metrics


class RoutingCost:
    def __init__(self, block_size: int, overlap_weight: float = 1.0, temperature: float = 0.0,
                 rng: random.Random | None = None) -> None:
        if overlap_weight < 0 or temperature < 0:
            raise ValueError("overlap_weight and temperature must be >= 0")
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self._rng = rng or random.Random()

    def choose(self, num_prompt_blocks: int, engine_to_load: Mapping[str, EngineLoad],
               engine_to_overlap: Mapping[str, int]) -> RoutingDecision:
        """Picks one of `engine_to_load`'s engines for a prompt of `num_prompt_blocks` blocks
        (a partial last block counted); `engine_to_overlap` says how many of its leading
        blocks each engine holds (an index's `overlaps` of the prompt's chain; an engine
        absent holds none; entries for non-candidates are ignored)."""
        if not engine_to_load:
            raise NoEngineError("no engine to route to")
        # In id order, so a seeded rng draws the same engine whatever the callers' order.
        engine_to_logit = {
            engine: self.overlap_weight * (
                num_prompt_blocks - engine_to_overlap.get(engine, 0)
                + load.num_pending_prefill_blocks)
            + load.num_active_blocks + load.num_session_blocks
            for engine, load in sorted(engine_to_load.items())}
        if self.temperature == 0:
            chosen = min(engine_to_logit, key=lambda e: (
                engine_to_logit[e], engine_to_load[e].num_blocks,
                engine_to_load[e].num_cached_blocks, e))
        else:
            chosen = self._sample(engine_to_logit)
        num_overlap = engine_to_overlap.get(chosen, 0)
        reason = RouteReason.KV_OVERLAP if num_overlap else RouteReason.LEAST_LOADED
        return RoutingDecision(chosen, reason, num_overlap * self.block_size, engine_to_logit)

    def _sample(self, engine_to_logit: dict[str, float]) -> str:
        low, high = min(engine_to_logit.values()), max(engine_to_logit.values())
        scale = (high - low) or 1.0   # all equal: every weight is 1, a uniform draw
        weights = [math.exp(-(logit - low) / scale / self.temperature)
                   for logit in engine_to_logit.values()]
        return self._rng.choices(list(engine_to_logit), weights)[0]
