"""Batch jobs against interactive latency, in one run:

1. interactive alone: --streams streaming chat requests one after another; ITL (every gap
   between consecutive content chunks, pooled) P50 / P99;
2. batch alone: a batch of --batch-lines requests through the Batches API; throughput as
   output tokens (and all tokens) per second from create to completed;
3. interactive during a batch: the same streams while a batch four times as large runs (at
   the batch priority), so it outlasts them; then that batch is cancelled.

A warm-up stream and a warm-up batch of the same shapes run first. On CPU, run it on an
idle machine: a worker whose cores are shared slows down several times (thread contention),
which swamps every figure here.

By default it starts `llm-mesh up --scheduling-policy priority` on free ports and stops it at
the end; --base-url measures a mesh that is already running (with a batch runner).

    .venv/bin/python -m benchmarks.batch [--batch-lines 256 --batch-tokens 64 \\
        --streams 8 --stream-tokens 128 --up-args "--max-concurrent-lines 32"]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai

from benchmarks.harness import distribution, markdown_table, mesh_up, print_preamble, progress

TERMINAL = {"completed", "failed", "expired", "cancelled"}
PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a bicycle stays upright.",
           "Describe the water cycle to a child.",
           "List some uses of copper and why."]


@contextmanager
def mesh(args: argparse.Namespace) -> Iterator[str]:
    """The base URL of the mesh to measure: the given one, or a fresh `llm-mesh up`."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    progress(f"starting the mesh (its log: {args.mesh_log})")
    with mesh_up(["--scheduling-policy", "priority", *shlex.split(args.up_args)],
                 Path(args.mesh_log)) as running:
        yield running.url


def stream_gaps(client: openai.OpenAI, model: str, count: int, max_tokens: int) -> list[float]:
    """Inter-token latencies (seconds) of `count` streaming requests, one after another."""
    gaps: list[float] = []
    for i in range(count):
        last = None
        stream = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        for chunk in stream:
            if not chunk.choices or not chunk.choices[0].delta.content:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def submit_batch(client: openai.OpenAI, model: str, lines: int, max_tokens: int) -> str:
    requests = [{"custom_id": f"bench-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": True,
                          "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]
                                        + f" (variant {i})"}]}}
                for i in range(lines)]
    data = "\n".join(json.dumps(r) for r in requests).encode() + b"\n"
    uploaded = client.files.create(file=("bench.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def wait_batch(client: openai.OpenAI, batch_id: str, until: Any) -> Any:
    while not until(batch := client.batches.retrieve(batch_id)):
        time.sleep(0.1)
    return batch


def batch_alone(client: openai.OpenAI, model: str, args: argparse.Namespace) -> dict[str, float]:
    started = time.perf_counter()
    batch_id = submit_batch(client, model, args.batch_lines, args.batch_tokens)
    batch = wait_batch(client, batch_id, lambda b: b.status in TERMINAL)
    elapsed = time.perf_counter() - started
    if batch.status != "completed" or batch.request_counts.failed:
        raise SystemExit(f"the batch did not complete cleanly: {batch}")
    return {"seconds": elapsed, "output_tokens": batch.usage.output_tokens,
            "output_tok_s": batch.usage.output_tokens / elapsed,
            "total_tok_s": batch.usage.total_tokens / elapsed}


def streams_during_batch(client: openai.OpenAI, model: str,
                         args: argparse.Namespace) -> tuple[list[float], bool]:
    """ITL gaps of the streams while a batch runs; whether the batch outlasted them."""
    batch_id = submit_batch(client, model, 4 * args.batch_lines, args.batch_tokens)
    wait_batch(client, batch_id, lambda b: b.request_counts.completed > 0 or b.status in TERMINAL)
    gaps = stream_gaps(client, model, args.streams, args.stream_tokens)
    outlasted = client.batches.retrieve(batch_id).status == "in_progress"
    try:
        client.batches.cancel(batch_id)
    except openai.BadRequestError:
        pass  # it has just finished
    wait_batch(client, batch_id, lambda b: b.status in TERMINAL)
    return gaps, outlasted


def itl_row(name: str, gaps: list[float]) -> list[str]:
    d = distribution(gaps)
    return [name, f"{d.p50:.1f}", f"{d.p99:.1f}", str(d.count)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="", help="measure this running mesh instead")
    parser.add_argument("--up-args", default="", help="extra `llm-mesh up` flags")
    parser.add_argument("--mesh-log", default=os.path.join(tempfile.gettempdir(),
                                                            "bench_batch_mesh.log"),
                        help="where the started mesh logs")
    parser.add_argument("--batch-lines", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    print_preamble()
    with mesh(args) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        progress("warming up")
        stream_gaps(client, model, 1, args.stream_tokens)
        warm_up = submit_batch(client, model, min(args.batch_lines, 64), args.batch_tokens)
        wait_batch(client, warm_up, lambda b: b.status in TERMINAL)
        progress("interactive streams alone")
        alone = stream_gaps(client, model, args.streams, args.stream_tokens)
        progress("batch alone")
        batch = batch_alone(client, model, args)
        progress("interactive streams while a batch runs")
        during, outlasted = streams_during_batch(client, model, args)
    print(f"\nbatch alone: {args.batch_lines} lines x {args.batch_tokens} tokens in "
          f"{batch['seconds']:.1f} s: {batch['output_tok_s']:.1f} output tokens/s, "
          f"{batch['total_tok_s']:.1f} total tokens/s\n")
    print(markdown_table(["interactive stream", "ITL P50 (ms)", "ITL P99 (ms)", "gaps"],
                         [itl_row("alone", alone), itl_row("while a batch runs", during)]))
    if not outlasted:
        print("\nwarning: the batch ended before the streams did; raise --batch-lines")


if __name__ == "__main__":
    main()
