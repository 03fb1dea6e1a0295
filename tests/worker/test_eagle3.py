"""EAGLE-3 speculative decoding on a tiny random target and a tiny random head built in the
checkpoint layout benchmarks/train_eagle3.py writes (vLLM's LlamaForCausalLMEagle3): every
draft is the head's own greedy chain as its trainer computes it (so the catch-up over the
target's kept hidden states, the head's KV and the chain are right, through chunked
prefills and rejections), greedy output is unchanged, and heads that cannot serve the
target are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.train_eagle3 import Eagle3Draft
from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver
from tests.worker.tiny_models import TINY

AUX_LAYER_IDS = [0, 2, 3]
NUM_SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    """The tiny Llama with 4 layers, to read 3 of them."""
    directory = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 4},
                                      tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def head(target: tuple[Path, transformers.PreTrainedModel],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Eagle3Draft]:
    """A random head over a draft vocabulary of 200 of the 256 tokens (so d2t maps)."""
    model_dir, hf = target
    torch.manual_seed(3)
    config = json.loads((model_dir / "config.json").read_text())
    draft_ids = torch.randperm(256)[:200].sort().values
    head = Eagle3Draft(config, draft_ids, hf.get_input_embeddings().weight.detach(),
                       AUX_LAYER_IDS).eval()
    directory = tmp_path_factory.mktemp("tiny-eagle3")
    head.save(directory)
    return directory, head


def make_runner(model_dir: Path, head_dir: Path | None) -> ModelRunner:
    spec = None if head_dir is None else SpeculativeConfig(
        "eagle3", NUM_SPECULATIVE_TOKENS, model=str(head_dir))
    return ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**21, max_num_seqs=4,
                                    max_model_len=256, max_num_batched_tokens=64,
                                    speculative_config=spec))


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (40, 9, 23)]


def run(runner: ModelRunner, token_budget: int) -> tuple[dict[int, list[int]], StepDriver]:
    driver = StepDriver(runner, token_budget)
    for tokens in prompts():
        driver.add(tokens, max_new_tokens=30, stop_at_eos=False)
    return driver.run(), driver


@torch.no_grad()
def reference_drafts(hf: transformers.PreTrainedModel, head: Eagle3Draft, context: list[int],
                     drafts: list[int]) -> list[int]:
    """The trainer's rollout over the context and the drafts: draft j is step j's argmax at
    the context's last position but one, plus j."""
    num_known = len(context)
    states = hf(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in AUX_LAYER_IDS], dim=-1)
    tokens = context + drafts
    aux = torch.cat((aux, aux.new_zeros(len(tokens) - 1 - len(aux), aux.shape[1])))
    outputs = head.rollout(aux[None], torch.tensor([tokens[1:]]), len(drafts))
    return [int(head.draft_token_ids[head.lm_head(out[0, num_known - 2 + j]).argmax()])
            for j, out in enumerate(outputs)]


def test_each_draft_is_the_heads_greedy_chain(target: tuple[Path, transformers.PreTrainedModel],
                                              head: tuple[Path, Eagle3Draft]) -> None:
    """Checked after every step of three concurrent requests with prefills chunked by a
    budget of 7 tokens; drafts get rejected (a random head), so positions are run again."""
    (model_dir, hf), (head_dir, trained) = target, head
    driver = StepDriver(make_runner(model_dir, head_dir), token_budget=7)
    for tokens in prompts():
        driver.add(tokens, max_new_tokens=24, stop_at_eos=False)
    num_checked = 0
    for context, drafts in driver.run_drafting():
        assert drafts == reference_drafts(hf, trained, context, drafts)
        num_checked += 1
    assert num_checked >= 20
    assert sum(r.num_verified for r in driver.requests.values()) > 0


@pytest.mark.parametrize("token_budget", [1 << 30, 7])
def test_greedy_output_is_unchanged(target: tuple[Path, transformers.PreTrainedModel],
                                    head: tuple[Path, Eagle3Draft], token_budget: int) -> None:
    model_dir, head_dir = target[0], head[0]
    plain, _ = run(make_runner(model_dir, None), token_budget)
    speculative, driver = run(make_runner(model_dir, head_dir), token_budget)
    assert speculative == plain
    assert sum(r.num_verified for r in driver.requests.values()) > 30


@pytest.mark.parametrize("edit,error", [
    ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}, "not three of"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 2]}}, "not three of"),
    ({"target_hidden_size": 32}, "hidden states of 32"),
    ({"vocab_size": 300}, "vocabulary of 300"),
    ({"num_hidden_layers": 2}, "only one-layer heads"),
])
def test_a_head_that_cannot_serve_the_target_is_refused(
        target: tuple[Path, transformers.PreTrainedModel], head: tuple[Path, Eagle3Draft],
        tmp_path: Path, edit: dict, error: str) -> None:
    head_dir = head[0]
    config = json.loads((head_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    (tmp_path / "model.safetensors").symlink_to(head_dir / "model.safetensors")
    with pytest.raises(ValueError, match=error):
        make_runner(target[0], tmp_path)
