"""Tiny random Llama-family models, saved as HF directories the ModelRunner can load."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from services.common import wire
from services.worker.runner.model_runner import ModelRunner
from tests.worker.driver import StepDriver

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
            eos_token_id=2)
VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama3_rope": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "linear_rope": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict()),
}


def save_tiny_model(name: str, directory: Path) -> transformers.PreTrainedModel:
    """Builds the random model (seeded), saves it to `directory` and returns it (fp32, eval)."""
    config_cls, extra = VARIANTS[name]
    config = config_cls(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model


def assert_logprobs_match_hf(hf: transformers.PreTrainedModel, runner: ModelRunner) -> None:
    """Prompt logprobs (every position, in three prefill chunks) and decode logprobs equal HF's
    log_softmax over the same tokens, and greedy decode took HF's argmax at every position.
    Logprobs, not greedy tokens alone: random models have near-tied logits."""
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
    assert req.output_ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()
