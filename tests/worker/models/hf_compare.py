"""Tiny random HF checkpoints of a new architecture, run by the ModelRunner against HF.

save_tiny_checkpoint builds the model from its HF config class (seeded), spreads its norm
weights (fresh norms are all ones, or zeros for Gemma's 1 + w, and a model with them mostly
echoes its input token) and saves it with safetensors. assert_matches_hf drives a ModelRunner
through chunked prefill and decodes and holds it to HF: every position's logprob within
tolerance of HF's forward pass, and greedy output equal to HF's greedy `generate`, in fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from services.common import wire
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver

VOCAB = 256
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.05,
    rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, pad_token_id=0)
# The attention paths the runner may take on a CPU: the C++ kernels, and the torch backend.
ATTENTION_PATHS = ("cpu_kernels", "torch")


def save_tiny_checkpoint(config: transformers.PretrainedConfig,
                         directory: Path) -> transformers.PreTrainedModel:
    """The random model (fp32, eval, eager attention), saved to `directory`."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + 2.0)
    model.save_pretrained(directory)
    return model


def use_attention_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend instead of the C++ kernels where `path` asks for it."""
    if path == "torch":
        monkeypatch.setenv("LLM_MESH_CPU_KERNELS", "0")


def assert_matches_hf(hf: transformers.PreTrainedModel, model_dir: Path, prompt_len: int = 45,
                      max_new_tokens: int = 8, token_budget: int = 20, atol: float = 1e-4,
                      num_forward_tokens: int | None = None) -> list[int]:
    """Runs a random prompt (chunks of `token_budget` tokens, then decodes) and compares it
    with HF. The logprobs are held to one HF forward pass over the first `num_forward_tokens`
    tokens (default: all of them). Returns the greedy output ids."""
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**20,
                                      max_num_seqs=4))
    prompt = torch.randint(3, VOCAB, (prompt_len,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    driver = StepDriver(runner, token_budget=token_budget)
    handle = driver.add(prompt, max_new_tokens=max_new_tokens,
                        sampling=wire.SamplingParams(logprobs=1, prompt_logprobs=1))
    driver.run()
    req = driver.requests[handle]
    with torch.no_grad():
        # NOTE: the forward pass first: HF's dynamic rope keeps the base generate grew to.
        tokens = torch.tensor(req.token_ids[:num_forward_tokens])
        ref = hf(tokens[None]).logits[0].log_softmax(-1)
        want_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                               do_sample=False)[0, prompt_len:].tolist()
    assert len(set(want_ids)) > 1, "HF's greedy output repeats one token: a weak test"
    assert req.output_ids == want_ids
    want = ref[torch.arange(len(tokens) - 1), tokens[1:]]
    got = torch.tensor([lp for _, lp in req.prompt_logprobs] + [lp for _, lp, *_ in req.logprobs])
    assert len(got) == len(req.token_ids) - 1
    got = got[:len(tokens) - 1]
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    return req.output_ids
