"""W8A8 int8 (--quantization int8) against fp32 and bf16 on the embedded model, in one run.

For each configuration, with the model runner in-process (no NATS):
- greedy agreement with fp32: the 12 prompts of tests/worker/test_runner_vs_hf.py (short,
  long, chat), 32 generated tokens each (EOS ignored): how many leading tokens equal fp32's,
  and how many prompts equal it in full;
- perplexity of benchmarks/perplexity_text.txt (~420 tokens of plain English), from the
  runner's prompt logprobs;
- decode step time (median, the best of --repeats runs) and tok/s at each batch size, and
  prefill tok/s (--prompt-len random tokens per request, steps of --max-num-batched-tokens),
  with benchmarks/runner.py's Driver.
The int8 rows run once more with the lm_head left in the model dtype (the rest int8), to show
what quantizing the lm_head costs and saves. One markdown table at the end.

    .venv/bin/python -m benchmarks.int8
    .venv/bin/python -m benchmarks.int8 --num-threads 1 --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from transformers import AutoTokenizer

from benchmarks.harness import markdown_table, print_preamble, progress
from benchmarks.runner import Driver, StepPhases, measure
from services.common import wire
from services.common.model_files import resolve_model
from services.worker.models.layers import Linear
from services.worker.models.weights import WeightSource
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver
from tests.worker.test_runner_vs_hf import CHAT_PROMPTS, MAX_NEW_TOKENS, RAW_PROMPTS

TEXT_FILE = Path(__file__).with_name("perplexity_text.txt")


@dataclass(frozen=True)
class Config:
    label: str
    dtype: str
    quantization: str = "none"
    is_lm_head_dense: bool = False   # int8 only: the lm_head stays in the model dtype


CONFIGS = [
    Config("fp32", "float32"),
    Config("bf16", "bfloat16"),
    Config("int8, fp32 activations", "float32", "int8"),
    Config("int8, bf16 activations", "bfloat16", "int8"),
    Config("int8, fp32 act., lm_head fp32", "float32", "int8", True),
    Config("int8, bf16 act., lm_head bf16", "bfloat16", "int8", True),
]


def read_text() -> str:
    """The perplexity text: paragraphs as written, lines within a paragraph rejoined."""
    paragraphs = TEXT_FILE.read_text().strip().split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def encode_prompts(tokenizer: AutoTokenizer) -> list[list[int]]:
    """The prompts HF's greedy output is checked on (tests/worker/test_runner_vs_hf.py)."""
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                           add_generation_prompt=True, tokenize=False)
             for c in CHAT_PROMPTS]
    return ([tokenizer(p)["input_ids"] for p in RAW_PROMPTS]
            + [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats])


def use_dense_lm_head(runner: ModelRunner) -> None:
    """Measurement only: puts back a dense lm_head in the model dtype (the instrument, as
    StepPhases wraps the runner's methods; the worker has no such option)."""
    weights = WeightSource(runner.config.model_dir, runner.config.torch_dtype, runner.device)
    tied = runner.model_config.tie_word_embeddings or "lm_head.weight" not in weights
    runner.model.lm_head = Linear(weights.get("embed_tokens.weight" if tied
                                              else "lm_head.weight"))


def greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    driver = StepDriver(runner)
    handles = [driver.add(p, MAX_NEW_TOKENS, stop_at_eos=False) for p in prompts]
    outputs = driver.run()
    return [outputs[h] for h in handles]


def perplexity(runner: ModelRunner, token_ids: list[int], budget: int) -> float:
    driver = StepDriver(runner, token_budget=budget)
    handle = driver.add(token_ids, 1, sampling=wire.SamplingParams(prompt_logprobs=0))
    driver.run()
    logprobs = [lp for _, lp in driver.requests[handle].prompt_logprobs]
    return math.exp(-statistics.fmean(logprobs))


def leading_matches(ours: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                min(len(ours), len(reference)))


def run_config(args: argparse.Namespace, config: Config, prompts: list[list[int]],
               text_ids: list[int]) -> tuple[list[list[int]], float, dict[int, float], float]:
    """(greedy outputs, perplexity, {batch: decode step ms}, prefill tok/s at the largest)."""
    runner = ModelRunner(RunnerConfig(
        model_dir=resolve_model("").hf_dir, dtype=config.dtype,
        quantization=config.quantization,
        max_model_len=max(max(map(len, prompts)) + MAX_NEW_TOKENS, len(text_ids),
                          args.prompt_len + args.decode_steps + 1),
        kv_cache_memory=2**30, max_num_seqs=max(args.batch_sizes + [len(prompts)]),
        max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.num_threads))
    if config.is_lm_head_dense:
        use_dense_lm_head(runner)
    outputs = greedy(runner, prompts)
    ppl = perplexity(runner, text_ids, args.max_num_batched_tokens)
    phases, driver = StepPhases(runner), Driver(runner, args.prompt_len, args.decode_steps)
    step_ms, prefill_tps = {}, 0.0
    for batch in args.batch_sizes:
        # NOTE: best of --repeats: other processes on a shared machine only ever slow a run.
        runs = [measure(args, driver, phases, [args.prompt_len] * batch)
                for _ in range(args.repeats)]
        step_ms[batch] = min(medians["step"] for medians, _ in runs)
        prefill_tps = max(tps for _, tps in runs)
    return outputs, ppl, step_ms, prefill_tps


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32",
                        type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3,
                        help="speed: measure each batch size this many times, keep the best")
    parser.add_argument("--num-threads", type=int, default=None, help="default: all cores")
    args = parser.parse_args(argv)
    print_preamble()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("").hf_dir)
    text = read_text()
    prompts, text_ids = encode_prompts(tokenizer), tokenizer(text)["input_ids"]
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens; perplexity text {len(text_ids)} tokens; {torch.get_num_threads()} threads",
          flush=True)
    rows, reference = [], None
    for config in CONFIGS:
        started = time.perf_counter()
        outputs, ppl, step_ms, prefill_tps = run_config(args, config, prompts, text_ids)
        reference = reference or outputs   # the first configuration, fp32
        matches = [leading_matches(o, r) for o, r in zip(outputs, reference)]
        progress(f"{config.label}: {time.perf_counter() - started:.0f} s, leading tokens "
                 f"equal to fp32's {matches}")
        rows.append([config.label, f"{ppl:.3f}",
                     f"{sum(o == r for o, r in zip(outputs, reference))}/{len(prompts)}",
                     f"{statistics.fmean(matches):.1f} (min {min(matches)})"]
                    + [f"{step_ms[b]:.1f} ms / {b / step_ms[b] * 1e3:.0f}"
                       for b in args.batch_sizes] + [f"{prefill_tps:.0f}"])
    header = (["config", "perplexity", "prompts = fp32", f"leading tokens = fp32 (of "
               f"{MAX_NEW_TOKENS})"] + [f"batch {b}: step / tok/s" for b in args.batch_sizes]
              + [f"prefill tok/s (batch {args.batch_sizes[-1]})"])
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
