"""The step plane without a model: what a step's codec and the local step channel cost.

1. Codec: a steady decode step of N running requests from the real scheduler core, encoded
   as the scheduler does (`encode_step_input` + serialize), parsed as the worker does; a
   StepOutput with one sampled token per row serialized as the worker does and parsed and
   decoded as the scheduler does. The same bytes through betterproto (`services/common/wire`,
   the control plane's classes) for comparison. Median microseconds of each.
2. Channel: the round trip of those frames over the local step channel
   (services/common/step_channel.py) to a worker thread that parses the step and answers
   with the StepOutput's bytes: the messaging of a step whose execute takes no time. The
   client runs on uvloop, as the services do.

Run: .venv/bin/python -m benchmarks.step_plane [--rows 8,32 --steps 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import uvloop

from benchmarks.harness import markdown_table, print_preamble
from benchmarks.scheduler import PrefillAwareExecutor, fake_execute
from services.common import wire, wire_pb
from services.common.packing import pack_int32
from services.common.step_channel import StepChannelClient, StepChannelServer
from services.scheduler.core import Request, Scheduler, SchedulerConfig
from services.scheduler.core.output import SchedulerOutput
from services.scheduler.step_codec import decode_step_output, encode_step_input

PROMPT_LEN = 128


def decode_steps(rows: int, steps: int) -> list[SchedulerOutput]:
    """`steps` consecutive decode steps of `rows` running requests, from the real core."""
    max_tokens = steps + 64
    blocks_per_request = -(-(PROMPT_LEN + max_tokens) // 16)
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=rows, max_num_batched_tokens=max(512, rows),
        max_model_len=PROMPT_LEN + max_tokens, policy="fcfs", async_scheduling=False,
        num_gpu_blocks=rows * blocks_per_request + 1))
    for i in range(rows):
        scheduler.add_request(Request(f"r{i}", list(range(i, i + PROMPT_LEN)),
                                      max_tokens=max_tokens, arrival_time=0.0,
                                      block_hasher=scheduler.block_hasher))
    executor = PrefillAwareExecutor()
    while scheduler.num_waiting or any(
            r.num_tokens - r.num_computed_tokens != 1 for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update_from_output(out, executor(out))
    outputs = []
    for _ in range(steps):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_execute(out))
        outputs.append(out)
    return outputs


def step_output(out: SchedulerOutput) -> wire_pb.StepOutput:
    """What the worker answers a decode step with: a token per row, no logprobs."""
    sampled = fake_execute(out)
    return wire_pb.StepOutput(step=out.step, handles=pack_int32(sampled.handles),
                              sampled_token_ids=pack_int32(sampled.sampled_token_ids),
                              execute_s=0.02)


def median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e3


def timed(fn: Callable[[], object]) -> int:
    started = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - started


def bench_codec(outputs: list[SchedulerOutput]) -> dict[str, float]:
    """Median µs of each half of a step's codec, in upb and (the same bytes) betterproto."""
    inputs = [encode_step_input(out).SerializeToString() for out in outputs]
    answers = [step_output(out).SerializeToString() for out in outputs]
    gc.collect()
    samples: dict[str, list[int]] = {name: [] for name in (
        "input: encode", "input: parse", "output: encode", "output: parse + decode",
        "input: betterproto encode", "input: betterproto parse",
        "output: betterproto encode", "output: betterproto parse")}
    for out, frame, answer in zip(outputs, inputs, answers, strict=True):
        samples["input: encode"].append(
            timed(lambda: encode_step_input(out).SerializeToString()))
        samples["input: parse"].append(timed(lambda: wire_pb.StepInput.FromString(frame)))
        samples["output: encode"].append(timed(lambda: step_output(out).SerializeToString()))
        samples["output: parse + decode"].append(
            timed(lambda: decode_step_output(wire_pb.StepOutput.FromString(answer))))
        step, reply = wire.StepInput().parse(frame), wire.StepOutput().parse(answer)
        samples["input: betterproto encode"].append(timed(lambda: bytes(step)))
        samples["input: betterproto parse"].append(timed(lambda: wire.StepInput().parse(frame)))
        samples["output: betterproto encode"].append(timed(lambda: bytes(reply)))
        samples["output: betterproto parse"].append(
            timed(lambda: wire.StepOutput().parse(answer)))
    return {name: median_us(values) for name, values in samples.items()}


async def _round_trips(name: str, frames: list[bytes]) -> list[int]:
    client = await StepChannelClient.connect(name)
    try:
        samples = []
        for frame in frames:
            started = time.perf_counter_ns()
            await client.send(frame)
            samples.append(time.perf_counter_ns() - started)
        return samples
    finally:
        client.close()


def bench_channel(outputs: list[SchedulerOutput]) -> float:
    """Median µs of a step's round trip over the local channel to a worker thread that
    parses it and answers at once."""
    answers = {out.step: step_output(out).SerializeToString() for out in outputs}
    server = StepChannelServer(f"bench-{uuid.uuid4().hex}")
    thread = threading.Thread(target=server.serve, name="step-channel", daemon=True, args=(
        lambda frame: answers[wire_pb.StepInput.FromString(frame).step],))
    thread.start()
    try:
        frames = [encode_step_input(out).SerializeToString() for out in outputs]
        return median_us(uvloop.run(_round_trips(server.name, frames)))
    finally:
        server.stop()
        thread.join()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,32", help="running requests, one run each")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    print_preamble()
    sizes = [int(n) for n in args.rows.split(",")]
    results = []
    for rows in sizes:
        outputs = decode_steps(rows, args.steps)
        codec = bench_codec(outputs)
        codec["channel round trip"] = bench_channel(outputs)
        results.append(codec)
    names = list(results[0])
    print("\nmedian µs per step\n")
    print(markdown_table(["", *(f"{rows} rows" for rows in sizes)],
                         [[name, *(f"{result[name]:.1f}" for result in results)]
                          for name in names]))
    for rows, result in zip(sizes, results, strict=True):
        upb = sum(result[name] for name in names[:4])
        betterproto = sum(result[name] for name in names[4:8])
        print(f"{rows} rows: a step's codec {upb:.1f} µs in upb, "
              f"{betterproto:.1f} µs in betterproto (serialize and parse only)")


if __name__ == "__main__":
    main()
