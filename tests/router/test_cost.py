"""RoutingCost: overlap against load, ties, and softmax sampling."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from services.frontend.router import EngineLoad, NoEngineError, RouteReason, RoutingCost

IDLE = EngineLoad()


def test_most_overlap_wins_among_equal_loads() -> None:
    decision = RoutingCost(block_size=16).choose(
        100, {"a": IDLE, "b": IDLE, "c": IDLE}, {"b": 60, "c": 30, "kvstore": 100})
    assert decision.engine_id == "b"
    assert decision.reason is RouteReason.KV_OVERLAP
    assert decision.num_predicted_cached_tokens == 60 * 16
    assert decision.engine_to_logit == {"a": 100.0, "b": 40.0, "c": 70.0}


def test_cold_prompt_goes_to_the_least_loaded() -> None:
    loads = {"a": EngineLoad(num_active_blocks=50), "b": EngineLoad(num_active_blocks=10),
             "c": EngineLoad(num_pending_prefill_blocks=30)}
    decision = RoutingCost(block_size=16).choose(20, loads, {})
    assert decision.engine_id == "b"
    assert decision.reason is RouteReason.LEAST_LOADED
    assert decision.num_predicted_cached_tokens == 0


def test_ties_go_to_the_least_loaded_then_the_lowest_id() -> None:
    cost = RoutingCost(block_size=16, overlap_weight=1.0)
    # Same logit (50): "a" by its overlap, "b" by its lighter load.
    loads = {"a": EngineLoad(num_active_blocks=40), "b": EngineLoad(num_active_blocks=0),
             "c": EngineLoad(num_active_blocks=0)}
    decision = cost.choose(60, loads, {"a": 50, "b": 10, "c": 10})
    assert decision.engine_to_logit == {"a": 50.0, "b": 50.0, "c": 50.0}
    assert decision.engine_id == "b"
    assert cost.choose(10, {"z": IDLE, "y": IDLE, "x": IDLE}, {}).engine_id == "x"


@pytest.mark.parametrize(("overlap_weight", "expected"), [(1.0, "idle"), (10.0, "loaded")])
def test_overlap_weight_trades_cache_against_load(overlap_weight: float, expected: str) -> None:
    # loaded: 50w + 200; idle: 100w. The loaded engine's cache wins past w = 4.
    loads = {"loaded": EngineLoad(num_active_blocks=200), "idle": IDLE}
    decision = RoutingCost(16, overlap_weight).choose(100, loads, {"loaded": 50})
    assert decision.engine_id == expected
    assert decision.reason is (RouteReason.KV_OVERLAP if expected == "loaded"
                               else RouteReason.LEAST_LOADED)


def test_pending_prefill_counts_as_prefill_work() -> None:
    loads = {"a": EngineLoad(num_pending_prefill_blocks=100), "b": EngineLoad()}
    decision = RoutingCost(16, overlap_weight=2.0).choose(100, loads, {"a": 50})
    assert decision.engine_to_logit == {"a": 300.0, "b": 200.0}
    assert decision.engine_id == "b"


def test_no_candidate_and_bad_settings_are_errors() -> None:
    with pytest.raises(NoEngineError):
        RoutingCost(16).choose(10, {}, {"a": 3})
    with pytest.raises(ValueError):
        RoutingCost(16, temperature=-1.0)


def sample(cost: RoutingCost, num_draws: int) -> list[str]:
    loads = {"a": IDLE, "b": IDLE, "c": IDLE}
    return [cost.choose(100, loads, {"a": 100, "b": 50}).engine_id for _ in range(num_draws)]


def test_sampling_is_deterministic_with_a_seeded_rng() -> None:
    draws = sample(RoutingCost(16, temperature=1.0, rng=random.Random(7)), 200)
    assert draws == sample(RoutingCost(16, temperature=1.0, rng=random.Random(7)), 200)
    assert len(set(draws)) == 3


def test_sampling_follows_the_softmax_of_normalized_logits() -> None:
    temperature, num_draws = 0.5, 20_000
    counts = Counter(sample(RoutingCost(16, temperature=temperature, rng=random.Random(1)),
                            num_draws))
    # Logits 0, 50, 100 normalize to 0, 0.5, 1.
    weights = {e: math.exp(-n / temperature) for e, n in {"a": 0, "b": 0.5, "c": 1}.items()}
    for engine, weight in weights.items():
        p = weight / sum(weights.values())
        # Within 5 standard deviations of a binomial count: fails by chance ~1e-6.
        assert abs(counts[engine] - p * num_draws) < 5 * math.sqrt(num_draws * p * (1 - p))


def test_equal_logits_sample_uniformly() -> None:
    cost = RoutingCost(16, temperature=1.0, rng=random.Random(3))
    counts = Counter(cost.choose(10, {"a": IDLE, "b": IDLE}, {}).engine_id
                     for _ in range(4000))
    assert abs(counts["a"] - 2000) < 5 * math.sqrt(4000 * 0.25)
