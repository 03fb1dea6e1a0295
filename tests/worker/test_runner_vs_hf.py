"""The model runner against HF transformers on the embedded SmolLM2-135M (the real model).

Greedy fp32 output must equal HF's greedy `generate` token for token, however the steps cut the
work: all prompts in one step, chunked prefill mixed with decodes, a cached prefix reused.
"""

from __future__ import annotations

import pytest
import torch

from services.common import wire
from services.common.model_files import resolve_model
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from services.worker.runner.warm_up import warm_up as run_warm_up
from tests.reference import hf_chat_prompt_ids, hf_greedy_ids, hf_model
from tests.worker.driver import StepDriver

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
         "clockmaker named Elias. Every morning he opened the wooden shutters of his shop, wound "
         "the hundred clocks that lined its walls, and listened as they began to tick in "
         "unison. Children from the village often gathered at his window to watch him work, "
         "fascinated by the tiny gears and springs spread across his bench. One winter, a "
         "stranger arrived carrying a clock that had not ticked in a hundred years. ")
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Hello",
    "La tour Eiffel se trouve à",
    "Q: What is 12 + 35?\nA:",
    STORY,
    STORY * 3 + "The stranger said:",
]
CHAT_PROMPTS = [
    "What is the tallest mountain in the world?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU cache is.",
    "List three primary colors.",
]


def _runner(dtype: str = "float32", kv_cache_dtype: str = "auto",
            gguf_blocks: bool = True, warm_up: bool = False) -> ModelRunner:
    """As the worker runs the embedded model: fp32 steps of a few rows read the GGUF's
    blocks (services/worker/models/gguf_blocks.py) unless `gguf_blocks` is off."""
    runner = ModelRunner(RunnerConfig(model_dir=resolve_model("").hf_dir, dtype=dtype,
                                      use_gguf_blocks=gguf_blocks,
                                      kv_cache_dtype=kv_cache_dtype, max_model_len=1024,
                                      kv_cache_memory=256 * 2**20, max_num_seqs=32))
    if warm_up:
        run_warm_up(runner)
    return runner


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    _, tokenizer = hf_model()
    raw = [tokenizer(p)["input_ids"] for p in RAW_PROMPTS]
    return raw + [hf_chat_prompt_ids(p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_fp32(prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy_ids(p, MAX_NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    # Warmed up as the worker service does: the throwaway request's blocks and row must
    # leave nothing behind that the tests below would see.
    return _runner(warm_up=True)


def _generate(runner: ModelRunner, prompts: list[list[int]], budget: int = 1 << 30,
              **add_kwargs) -> list[list[int]]:
    driver = StepDriver(runner, token_budget=budget)
    handles = [driver.add(p, MAX_NEW_TOKENS, **add_kwargs) for p in prompts]
    outputs = driver.run()
    return [outputs[h] for h in handles]


def test_the_warm_up_leaves_no_row_behind(runner: ModelRunner) -> None:
    assert runner.input_batch.num_reqs == 0


def test_prompts_are_varied(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 10 and lengths[0] <= 2 and lengths[-1] > 256
    assert any(n % 16 == 0 for n in lengths) or any(n % 16 == 1 for n in lengths)


def test_greedy_matches_hf_all_prompts_in_one_step(runner: ModelRunner, prompts, hf_fp32) -> None:
    assert _generate(runner, prompts) == hf_fp32


def test_greedy_matches_hf_with_dense_weights_only(prompts, hf_fp32) -> None:
    runner = _runner(gguf_blocks=False)
    assert all(lin.quantized is None for layer in runner.model.layers for lin in layer.linears)
    # Four prompts keep it short: every product is dense here whatever the batch size.
    assert _generate(runner, prompts[:4]) == hf_fp32[:4]


def test_small_batches_read_the_gguf_blocks(runner: ModelRunner) -> None:
    model = runner.model
    assert all(lin.quantized is not None for layer in model.layers for lin in layer.linears)
    assert model.lm_head.quantized is not None
    assert model.small_batch_bytes < model.num_bytes / 4


def test_greedy_matches_hf_with_chunked_prefill(runner: ModelRunner, prompts, hf_fp32) -> None:
    # 40 tokens a step: prompts are cut mid-block and run beside other requests' decodes.
    assert _generate(runner, prompts, budget=40) == hf_fp32


def test_greedy_matches_hf_with_cached_prefix(runner: ModelRunner, prompts) -> None:
    _, tokenizer = hf_model()
    first = tokenizer(STORY + "Who was Elias?")["input_ids"]
    second = tokenizer(STORY + "What did the stranger carry?")["input_ids"]
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    bs = runner.info.block_size
    driver = StepDriver(runner, token_budget=64)
    a = driver.add(first, MAX_NEW_TOKENS)
    driver.run()
    b = driver.add(second, MAX_NEW_TOKENS, prefix_of=a, num_prefix_blocks=common // bs)
    # The whole prompt cached but its last token (a prefix hit never covers the last token).
    c = driver.add(first, MAX_NEW_TOKENS, prefix_of=a,
                   num_prefix_blocks=(len(first) - 1) // bs)
    outputs = driver.run()
    assert common // bs >= 4
    assert outputs[b] == hf_greedy_ids(second, MAX_NEW_TOKENS)
    assert outputs[c] == outputs[a] == hf_greedy_ids(first, MAX_NEW_TOKENS)


def test_logprobs_and_prompt_logprobs_match_hf(runner: ModelRunner, prompts) -> None:
    model, _ = hf_model()
    prompt = prompts[5]
    sampling = wire.SamplingParams(logprobs=3, prompt_logprobs=2)
    driver = StepDriver(runner, token_budget=7)  # several prompt-logprob chunks
    handle = driver.add(prompt, 8, sampling=sampling)
    driver.run()
    req = driver.requests[handle]
    tokens = req.token_ids
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    assert req.prompt_logprobs_done
    assert [t for t, _ in req.prompt_logprobs] == prompt[1:]
    want_prompt = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor([lp for _, lp in req.prompt_logprobs]), want_prompt,
                          atol=1e-4)
    outputs = req.output_ids
    positions = torch.arange(len(prompt) - 1, len(tokens) - 1)
    want = ref[positions, torch.tensor(outputs)]
    assert [t for t, *_ in req.logprobs] == outputs
    assert torch.allclose(torch.tensor([lp for _, lp, *_ in req.logprobs]), want, atol=1e-4)
    top_ids = [ids for *_, ids, _ in req.logprobs]
    assert top_ids == ref[positions].topk(3).indices.tolist()


def _agreement(ours: list[list[int]], refs: list[list[int]]) -> tuple[int, list[int]]:
    """(prompts matching in full, leading tokens that match per prompt)."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
                for o, r in zip(ours, refs)]
    return sum(o == r for o, r in zip(ours, refs)), prefixes


def test_bf16_departs_from_hf_bf16_only_at_near_ties(prompts, hf_fp32) -> None:
    """bf16 keeps ~3 significant digits, so near-tied logits flip with any change in
    summation order (batching, kernels, the CPU's bf16 GEMM): how many prompts match HF's
    bf16 for every token depends on the machine. What holds everywhere is that where our
    bf16 greedy output first departs from HF's, the two tokens were a near-tie: both among
    the fp32 model's top 5, and their fp32 logits closer than twice the error bf16 itself
    adds at that position (HF's bf16 logits against its fp32 ones, over the top 5; at least
    one bf16 step of the largest logit)."""
    hf_bf16 = [hf_greedy_ids(p, MAX_NEW_TOKENS, dtype=torch.bfloat16) for p in prompts]
    ours = _generate(_runner("bfloat16"), prompts)
    matches, prefixes = _agreement(ours, hf_bf16)
    hf_self, _ = _agreement(hf_bf16, hf_fp32)
    print(f"bf16: {matches}/{len(prompts)} prompts match HF bf16 for {MAX_NEW_TOKENS} tokens, "
          f"first divergence at {sorted(prefixes)} (HF bf16 matches HF fp32 on "
          f"{hf_self}/{len(prompts)})")
    fp32_model, _ = hf_model()
    bf16_model, _ = hf_model(torch.bfloat16)
    for prompt, mine, theirs, agreed in zip(prompts, ours, hf_bf16, prefixes):
        if agreed >= min(len(mine), len(theirs)):
            continue  # no departure (or one output ended with EOS where the other went on)
        context = torch.tensor([prompt + mine[:agreed]])
        with torch.no_grad():
            exact = fp32_model(context).logits[0, -1].float()
            rounded = bf16_model(context).logits[0, -1].float()
        ours_token, hf_token = mine[agreed], theirs[agreed]
        top5 = set(torch.topk(exact, 5).indices.tolist())
        assert {ours_token, hf_token} <= top5, (prompt, agreed, ours_token, hf_token)
        gap = (exact[ours_token] - exact[hf_token]).abs().item()
        bf16_noise = max((rounded - exact)[list(top5)].abs().max().item(),
                         exact.max().abs().item() * 2**-7)
        # Whichever side picked the lower token moved two logits, each by up to that error,
        # in opposite directions: a flip closes a gap of up to twice it (an AVX2 Zen 3 saw
        # 0.18 against an error of 0.14).
        assert gap <= 2 * bf16_noise, (prompt, agreed, gap, bf16_noise)


def test_fp8_kv_cache_mostly_matches_fp32(prompts, hf_fp32) -> None:
    ours = _generate(_runner(kv_cache_dtype="fp8"), prompts)
    matches, prefixes = _agreement(ours, hf_fp32)
    print(f"fp8 KV: {matches}/{len(prompts)} prompts match HF fp32 for {MAX_NEW_TOKENS} "
          f"tokens, first divergence at {sorted(prefixes)}")
    assert matches >= len(prompts) // 3
    assert min(prefixes) >= 4
