"""MTP speculative decoding (method mtp) on tiny random checkpoints in MiMo's layout
(benchmarks/mtp_checkpoint.py: a Qwen2 target with model.mtp_layers.0.*): the drafts' logits
are the MTP formula's on the same weights (a plain torch reference over HF's Qwen2 block),
through chunked prefills and rejections; greedy output is unchanged; a layer built to be
right drafts accepted tokens; a checkpoint without MTP tensors is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from benchmarks.mtp_checkpoint import MTP_PREFIX, save_mimo_checkpoint
from benchmarks.spec_compare import serve
from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.model_runner import ModelRunner
from tests.spec_decode.test_runner_spec import generate, prompts
from tests.spec_decode.test_runner_spec import make_runner as spec_runner
from tests.worker.driver import StepDriver
from tests.worker.tiny_models import TINY

NUM_SPECULATIVE_TOKENS = 2
Checkpoint = tuple[Path, transformers.PreTrainedModel, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    directory = tmp_path_factory.mktemp("tiny-mimo")
    return directory, *save_mimo_checkpoint(directory, TINY, mtp="random")


@pytest.fixture(scope="module")
def bigram_mtp(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    directory = tmp_path_factory.mktemp("tiny-mimo-bigram")
    return directory, *save_mimo_checkpoint(directory, TINY, mtp="bigram", layer_scale=0.05)


def make_runner(model_dir: Path) -> ModelRunner:
    return spec_runner(model_dir, SpeculativeConfig("mtp", NUM_SPECULATIVE_TOKENS))


class MTPReference:
    """The MTP formula in plain torch over the checkpoint's tensors, its decoder block run
    by HF's Qwen2 (one layer, whose final norm is final_layernorm)."""

    def __init__(self, target: transformers.PreTrainedModel, tensors: dict[str, torch.Tensor]):
        self.target = target
        mtp = {name.removeprefix(MTP_PREFIX): value for name, value in tensors.items()}
        config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 1})
        self.block = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
        state = {"layers.0." + name: value for name, value in mtp.items()
                 if name.startswith(("self_attn.", "mlp.", "input_layernorm",
                                     "post_attention_layernorm"))}
        state |= {"norm.weight": mtp["final_layernorm.weight"],
                  "embed_tokens.weight": self.block.embed_tokens.weight}
        self.block.load_state_dict(state)
        self.mtp = mtp

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, TINY["rms_norm_eps"])

    @torch.no_grad()
    def draft_logits(self, context: list[int], num_drafts: int) -> list[torch.Tensor]:
        """Logits of each draft after `context`, the drafts being their argmax: position p
        runs token p + 1 with the target's last hidden state (before its final norm) at p;
        a draft's position runs it with the previous position's output."""
        streams = []
        hook = self.target.model.norm.register_forward_hook(
            lambda module, args, output: streams.append(args[0][0]))
        self.target(torch.tensor([context]))
        hook.remove()
        hidden = streams[0][:-1]
        tokens = context[1:]
        logits = []
        for _ in range(num_drafts):
            positions = torch.arange(len(tokens))
            embeds = self.target.model.embed_tokens(torch.tensor(tokens))
            embeds[positions == 0] = 0
            both = torch.cat((self._rms(hidden, self.mtp["hidden_layernorm.weight"]),
                              self._rms(embeds, self.mtp["token_layernorm.weight"])), dim=-1)
            out = self.block(inputs_embeds=(both @ self.mtp["input_proj.weight"].T)[None],
                             position_ids=positions[None]).last_hidden_state[0]
            logits.append(self.target.lm_head(out[-1]))
            tokens = tokens + [int(logits[-1].argmax())]
            hidden = torch.cat((hidden, out[-1:]))
        return logits


def test_draft_logits_are_the_mtp_formulas(random_mtp: Checkpoint) -> None:
    """One request: every step's draft logits equal the reference's over the row's tokens."""
    model_dir, target, tensors = random_mtp
    reference = MTPReference(target, tensors)
    runner = make_runner(model_dir)
    head = runner.speculator.proposer.head
    seen: list[torch.Tensor] = []
    greedy_tokens = head.greedy_tokens

    def seeing_greedy_tokens(normed: torch.Tensor) -> torch.Tensor:
        seen.extend(runner.model.compute_logits(normed))
        return greedy_tokens(normed)

    head.greedy_tokens = seeing_greedy_tokens
    driver = StepDriver(runner)
    driver.add(prompts()[0], max_new_tokens=16, stop_at_eos=False)
    num_checked = 0
    for context, drafts in driver.run_drafting():   # one row: the step's drafts are seen
        want = reference.draft_logits(context, len(drafts))
        torch.testing.assert_close(torch.stack(seen), torch.stack(want), atol=1e-4, rtol=1e-4)
        seen.clear()
        num_checked += 1
    assert num_checked >= 5


def test_each_draft_is_the_reference_chain(random_mtp: Checkpoint) -> None:
    """Three concurrent requests, prefills chunked by a budget of 7 tokens; random drafts
    are rejected, so positions are run again with the target's states."""
    model_dir, target, tensors = random_mtp
    reference = MTPReference(target, tensors)
    driver = StepDriver(make_runner(model_dir), token_budget=7)
    for tokens in prompts():
        driver.add(tokens, max_new_tokens=16, stop_at_eos=False)
    num_checked = 0
    for context, drafts in driver.run_drafting():
        assert drafts == [int(logits.argmax())
                          for logits in reference.draft_logits(context, len(drafts))]
        num_checked += 1
    assert num_checked >= 20


@pytest.mark.parametrize("token_budget", [1 << 30, 7])
def test_greedy_output_is_unchanged(random_mtp: Checkpoint, bigram_mtp: Checkpoint,
                                    token_budget: int) -> None:
    mtp = SpeculativeConfig("mtp", NUM_SPECULATIVE_TOKENS)
    for model_dir in (random_mtp[0], bigram_mtp[0]):
        plain, _ = generate(model_dir, None, token_budget=token_budget)
        speculative, driver = generate(model_dir, mtp, token_budget=token_budget)
        assert speculative == plain
        assert sum(r.num_verified for r in driver.requests.values()) > 30


def test_a_layer_built_to_be_right_is_accepted(bigram_mtp: Checkpoint) -> None:
    """The bigram MTP layer drafts the target's next token as the token alone would have it;
    the target's scaled-down layers make that right often, not always: acceptance length
    (1 + accepted drafts per verifying step) well above 1."""
    served = serve(make_runner(bigram_mtp[0]), prompts(), 30)
    assert 1 + served["accepted"] / served["verifying"] > 1.5
    assert served["accepted"] < served["drafted"]   # some rejected: the context counts


def test_a_checkpoint_without_mtp_layers_is_refused(random_mtp: Checkpoint,
                                                   tmp_path: Path) -> None:
    model_dir = random_mtp[0]
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    weights = load_file(model_dir / "model.safetensors")
    save_file({name: value for name, value in weights.items() if "mtp_layers" not in name},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"no usable MTP layer \(config.json's "
                       r"num_nextn_predict_layers: 0\): missing 16 of MiMo's tensors, e.g. "
                       r"model\.mtp_layers\.0\.token_layernorm\.weight"):
        make_runner(tmp_path)
