"""benchmarks/engine_alone.py on the real model: a closed-loop run keeps its requests in
flight until each has its tokens, and its figures come from those tokens."""

from __future__ import annotations

import random

from benchmarks.engine_alone import EngineAlone, summarize


def test_a_closed_loop_run_ends_every_request_with_its_tokens() -> None:
    engine = EngineAlone("float32", kv_cache_memory=400 * 2**20)
    try:
        result = engine.run(concurrency=2, num_prompts=3, input_len=40, output_len=6,
                            rng=random.Random(0))
    finally:
        engine.close()
    assert [len(t.token_times) for t in result.timelines] == [6, 6, 6]
    assert result.output_tokens == 18
    # The third request starts only when one of the first two ends: two waves of 6 tokens,
    # the first token of each wave coming with its prompt's last step.
    assert result.steps >= 12
    assert all(t.token_times == sorted(t.token_times) for t in result.timelines)
    assert result.timelines[2].arrival >= min(t.token_times[-1] for t in result.timelines[:2])
    concurrency, _, _, tpot, _, steps, _, _ = summarize(result)
    assert (concurrency, steps) == ("2", str(result.steps)) and float(tpot) > 0
