"""Each supported architecture against HF transformers, on tiny random models (fast).

A random model is built with transformers from a small config, saved as an HF directory and
loaded by the ModelRunner; prompt logprobs (every position, computed in chunks) and decode
logprobs must equal HF's log_softmax over the same tokens. Logprobs, not greedy tokens: random
models have near-tied logits, and logprobs compare every position exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.tiny_models import VARIANTS, assert_logprobs_match_hf, save_tiny_model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_hf(name: str, tmp_path: Path) -> None:
    hf = save_tiny_model(name, tmp_path)
    runner = ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20,
                                      max_num_seqs=4))
    assert_logprobs_match_hf(hf, runner)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(RunnerConfig(model_dir=tmp_path))
