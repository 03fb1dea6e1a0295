"""The draft-model proposer on tiny random checkpoints: its drafts are the draft model's own
greedy continuation at every step (so its KV, caught up after rejections and chunked over
long prompts, holds the right tokens), the target as its own draft has every draft accepted,
and a draft that cannot serve the target is refused. (Greedy and seeded output equal to the
output without speculation: test_runner_spec.py, parametrized over every method.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from services.common.speculative_config import SpeculativeConfig
from tests.spec_decode.test_runner_spec import generate, make_runner, prompts
from tests.worker.driver import StepDriver


def draft_config(model_dir: Path) -> SpeculativeConfig:
    return SpeculativeConfig("draft_model", num_speculative_tokens=3, model=str(model_dir))


def hf_greedy(model: transformers.PreTrainedModel, context: list[int],
              num_tokens: int) -> list[int]:
    ids = torch.tensor([context])
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat((ids, next_id.view(1, 1)), dim=1)
    return ids[0, len(context):].tolist()


def test_each_draft_is_the_draft_models_greedy_continuation(model_dir: Path,
                                                            draft_model_dir: Path) -> None:
    """Checked after every step of three concurrent requests, prefills chunked (the target's
    by the step budget, the draft's catch-up by max_num_batched_tokens), drafts rejected."""
    driver = StepDriver(make_runner(model_dir, draft_config(draft_model_dir)), token_budget=7)
    for tokens in prompts():
        driver.add(tokens, max_new_tokens=24, stop_at_eos=False)
    draft = transformers.AutoModelForCausalLM.from_pretrained(draft_model_dir).eval()
    num_checked = 0
    for context, drafts in driver.run_drafting():
        assert drafts == hf_greedy(draft, context, len(drafts))
        num_checked += 1
    verified = sum(r.num_verified for r in driver.requests.values())
    accepted = sum(r.num_accepted for r in driver.requests.values())
    assert num_checked >= 20 and 0 < accepted < verified   # some drafts were rejected


def test_the_target_as_its_own_draft_has_every_draft_accepted(model_dir: Path) -> None:
    """Greedy drafts of the target itself are the target's next tokens, if its KV is right:
    also for a second round of requests on the first round's rows and blocks, whose KV in
    the draft's cache belongs to other tokens.
    NOTE: fp32 on one device; a draft could only be rejected at a near-tie of the top two
    logits, which these random models' greedy paths do not come near."""
    runner = make_runner(model_dir, draft_config(model_dir))
    plain, _ = generate(model_dir, None, token_budget=7)
    for order in (1, -1):
        driver = StepDriver(runner, token_budget=7)
        for tokens in prompts()[::order]:
            driver.add(tokens, max_new_tokens=40, stop_at_eos=False)
        outputs = list(driver.run().values())
        assert outputs == list(plain.values())[::order]
        verified = sum(r.num_verified for r in driver.requests.values())
        assert verified > 60
        assert sum(r.num_accepted for r in driver.requests.values()) == verified


@pytest.mark.parametrize("edit,error", [
    ({"vocab_size": 320}, "vocabulary of 320 tokens, the target 256"),
    ({"max_position_embeddings": 128}, "128 tokens of context"),
    (None, "not found"),
])
def test_a_draft_that_cannot_serve_the_target_is_refused(
        model_dir: Path, draft_model_dir: Path, tmp_path: Path, edit: dict[str, int] | None,
        error: str) -> None:
    if edit is not None:   # the checks read config.json, before any weights
        config = json.loads((draft_model_dir / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=error):
        make_runner(model_dir, draft_config(tmp_path))


def test_the_draft_kv_comes_out_of_the_kv_budget(model_dir: Path,
                                                 draft_model_dir: Path) -> None:
    """Both caches are indexed by the same block ids: one block count fits both in the
    budget (make_runner's 2 MiB)."""
    plain = make_runner(model_dir, None)
    drafted = make_runner(model_dir, draft_config(draft_model_dir))
    # The draft (conftest.DRAFT_SHAPE): 1 layer, 1 KV head of 32 / 2 = 16 dims, fp32, K and V.
    draft_bytes_per_block = 2 * 1 * 1 * 16 * 4 * plain.block_size
    target_bytes_per_block = plain.kv_spec.bytes_per_block
    assert plain.info.num_blocks == 2**21 // target_bytes_per_block
    assert drafted.info.num_blocks == 2**21 // (target_bytes_per_block + draft_bytes_per_block)
