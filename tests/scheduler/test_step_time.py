"""The fitted step time and the prefill cap it gives beside running decodes."""

from __future__ import annotations

import random

import pytest

from services.scheduler.core.step_time import StepTimeModel

A, B, C = 0.010, 0.002, 0.0015     # seconds: fixed, per decode token, per prefill token


def observed(model: StepTimeModel, steps: list[tuple[int, int]], noise: float = 0.0,
             seed: int = 0) -> StepTimeModel:
    rng = random.Random(seed)
    for num_decode, num_prefill in steps:
        seconds = A + B * num_decode + C * num_prefill
        model.observe(num_decode, num_prefill, seconds * (1 + rng.uniform(-noise, noise)))
    return model


def mixed_steps(count: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 32), rng.choice([0, 0, rng.randint(1, 128)])) for _ in range(count)]


def test_the_fit_recovers_the_step_time_of_mixed_steps() -> None:
    fit = observed(StepTimeModel(), mixed_steps(300), noise=0.02).coefficients()
    assert fit is not None
    assert fit == pytest.approx((A, B, C), rel=0.1)


def test_no_fit_and_no_cap_until_enough_steps_ran() -> None:
    model = observed(StepTimeModel(min_steps=16), mixed_steps(15))
    assert model.coefficients() is None
    assert model.prefill_token_cap(8, 2.0) is None
    observed(model, mixed_steps(1, seed=1))
    assert model.coefficients() is not None


def test_the_cap_keeps_a_step_within_the_factor_of_its_decode_only_time() -> None:
    model = observed(StepTimeModel(), mixed_steps(300))
    for num_decode, factor in [(1, 2.0), (8, 2.0), (8, 1.5), (32, 3.0)]:
        cap = model.prefill_token_cap(num_decode, factor)
        decode_only = A + B * num_decode
        assert cap is not None
        assert A + B * num_decode + C * cap <= factor * decode_only * 1.001
        assert A + B * num_decode + C * (cap + 2) > factor * decode_only


def test_no_cap_without_decodes_or_with_the_guard_off() -> None:
    model = observed(StepTimeModel(), mixed_steps(300))
    assert model.prefill_token_cap(0, 2.0) is None
    assert model.prefill_token_cap(8, 0.0) is None


def test_no_cap_before_prefill_was_seen() -> None:
    """Decode-only steps say nothing of what a prefill token costs: no cap, and the first
    chunk beside decodes teaches it."""
    model = observed(StepTimeModel(), [(8, 0)] * 50)
    assert model.prefill_token_cap(8, 2.0) is None
    observed(model, [(8, 64), (7, 100), (8, 20)] * 3)
    assert model.prefill_token_cap(8, 2.0) == pytest.approx((A + 8 * B) / C, abs=2)


def test_after_single_streams_a_decode_token_is_priced_as_a_prompt_token() -> None:
    """Decode steps of one row and prompts prefilled alone cannot tell the fixed cost from
    the per-decode one: the fit prices a decode token as a prompt token (C) rather than as
    nothing, so a step of 8 decodes is expected to take A + 8C, not A + B."""
    model = observed(StepTimeModel(), [(1, 0)] * 40 + [(0, 128)] * 4)
    a, b, c = model.coefficients()
    assert c == pytest.approx(C, rel=0.01)
    assert a + 8 * b == pytest.approx(A + B - C + 8 * C, rel=0.01)


def test_a_constant_batch_still_predicts_its_decode_only_step() -> None:
    """Every step with 8 decodes: the fixed and per-decode costs cannot be told apart, but
    their sum at 8 decodes can, and that sets the cap."""
    model = observed(StepTimeModel(), [(8, p) for p in [0, 0, 16, 0, 64, 0, 128, 0] * 20])
    assert model.prefill_token_cap(8, 2.0) == pytest.approx((A + 8 * B) / C, abs=2)


def test_the_fit_follows_a_machine_that_slows_down() -> None:
    model = observed(StepTimeModel(half_life=32), mixed_steps(300))
    before = model.prefill_token_cap(8, 2.0)
    rng = random.Random(3)
    for num_decode, num_prefill in mixed_steps(300, seed=5):
        # Decodes twice as slow (another tenant on the memory bus), prefill unchanged.
        model.observe(num_decode, num_prefill, A + 2 * B * num_decode + C * num_prefill
                      + rng.uniform(0, 1e-6))
    after = model.prefill_token_cap(8, 2.0)
    assert before is not None and after is not None
    assert after == pytest.approx((A + 16 * B) / C, abs=2)
    assert after > before
