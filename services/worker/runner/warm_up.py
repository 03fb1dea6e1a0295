"""A throwaway request run through the worker before it says it is ready, as vLLM's dummy
run does: the first call of each matrix-product shape has oneDNN create its kernels and the
allocator grow its pools, a cost the first users' requests would pay otherwise (fp32: 12% of
a first 910-token prefill; docs/benchmarks.md 10b).

It runs through ModelRunner.execute like any step (prefill chunk, decode, finish) in blocks
no request holds yet, greedy so it draws nothing from the sampler's generator.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import structlog

from services.common import wire_pb
from services.common.packing import pack_int32

if TYPE_CHECKING:
    from services.worker.runner.model_runner import ModelRunner

log = structlog.get_logger(__name__)

_HANDLE = 0x7FFF_FFFF       # beyond any handle a scheduler gives out
_NUM_DECODE_STEPS = 2


def warm_up(runner: ModelRunner) -> None:
    """Prefills one step's worth of tokens (the scheduler's chunk) and decodes a few."""
    block_size = runner.block_size
    usable_blocks = runner.info.num_blocks - 1          # block 0 stays the null block
    num_tokens = min(runner.config.max_num_batched_tokens,
                     runner.max_model_len - _NUM_DECODE_STEPS,
                     usable_blocks * block_size - _NUM_DECODE_STEPS)
    if num_tokens <= 0:
        return
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, runner.info.vocab_size, num_tokens)
    blocks = range(1, 1 + -(-(num_tokens + _NUM_DECODE_STEPS) // block_size))
    steps = [wire_pb.StepInput(step=0, new_requests=[wire_pb.NewRequestData(
        handle=_HANDLE, request_id="warm-up", token_ids=pack_int32(prompt),
        num_prompt_tokens=num_tokens, block_ids=pack_int32(blocks),
        sampling=wire_pb.SamplingParams(temperature=0.0, ignore_eos=True))],
        num_scheduled_tokens=pack_int32([num_tokens]))]
    for i in range(_NUM_DECODE_STEPS):
        steps.append(wire_pb.StepInput(
            step=1 + i, cached_handles=pack_int32([_HANDLE]),
            cached_num_new_blocks=pack_int32([0]),
            cached_num_computed_tokens=pack_int32([num_tokens + i]),
            num_scheduled_tokens=pack_int32([1])))
    for step in steps:
        out = runner.execute(step)
        if out.error:
            # Not fatal: the weights loaded, and a model that cannot step fails each request
            # with the reason; this says it before the first one.
            log.warning("the warm-up step failed", error=out.error)
            break
    else:
        log.info("warmed up", prompt_tokens=num_tokens, decode_steps=_NUM_DECODE_STEPS,
                 seconds=round(time.perf_counter() - started, 2))
    # Its row goes whatever happened: no real request may find it.
    runner.execute(wire_pb.StepInput(step=1 + _NUM_DECODE_STEPS,
                                  finished_handles=pack_int32([_HANDLE])))
