"""Each supported architecture against HF transformers, on tiny random models (fast).

A random model is built with transformers from a small config, saved as an HF directory and
loaded by the ModelRunner; prompt logprobs (every position, computed in chunks) and decode
logprobs must equal HF's log_softmax over the same tokens. Logprobs, not greedy tokens: random
models have near-tied logits, and logprobs compare every position exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common import wire
from services.worker.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver
from tests.worker.tiny_models import VARIANTS, save_tiny_model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_hf(name: str, tmp_path: Path) -> None:
    hf = save_tiny_model(name, tmp_path)
    runner = ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20,
                                      max_num_seqs=4))
    prompt = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    driver = StepDriver(runner, token_budget=20)  # three prefill chunks, not block-aligned
    handle = driver.add(prompt, max_new_tokens=6, stop_at_eos=False,
                        sampling=wire.SamplingParams(logprobs=1, prompt_logprobs=1))
    driver.run()
    req = driver.requests[handle]
    tokens = torch.tensor(req.token_ids)
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0].log_softmax(-1)
    want = ref[torch.arange(len(tokens) - 1), tokens[1:]]
    got = torch.tensor([lp for _, lp in req.prompt_logprobs] + [lp for _, lp, *_ in req.logprobs])
    assert len(got) == len(tokens) - 1
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # Greedy decode took HF's argmax at every position.
    assert req.output_ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(RunnerConfig(model_dir=tmp_path))
