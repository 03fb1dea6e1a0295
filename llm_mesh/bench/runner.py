"""Runs one benchmark point: requests arrive at a rate (Poisson, or gamma for burstiness),
each waits for a slot under an optional concurrency cap, and all stream concurrently.
A multi-turn session (sessions.py) arrives the same way, as one job that holds its slot
while its turns go one after another.

Arrival times are drawn up front and slept to from the start, so a slow send never
shifts later arrivals (no drift), and the draw is seeded for repeatable runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from tqdm import tqdm

from llm_mesh.bench.openai_client import EncodedRequest, OpenAIClient
from llm_mesh.bench.stream_parser import RequestResult

Job = Callable[[], Awaitable[list[RequestResult]]]   # one arrival: a request, or a session


@dataclass(frozen=True)
class BenchmarkPoint:
    """One point of a sweep; `request_rate` inf sends all at once, None concurrency = no cap."""

    request_rate: float
    max_concurrency: int | None

    @property
    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = "" if self.max_concurrency is None else f" c={self.max_concurrency}"
        return f"rate={rate}{conc}"


@dataclass
class RunResult:
    point: BenchmarkPoint
    results: list[RequestResult]
    duration_s: float
    client_cpu_s: float     # this process's CPU time during the run: the client's own cost


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds from the start of each arrival (a request, or a session's first turn)."""
    if math.isinf(rate):
        return np.zeros(num)
    # Gamma inter-arrivals with shape k and mean 1/rate: k=1 is Poisson, k<1 burstier.
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)


def progress_bar(num_requests: int, point: BenchmarkPoint, show: bool) -> tqdm:
    return tqdm(total=num_requests, desc=point.label, unit="req", leave=False, disable=not show)


async def run_point(client: OpenAIClient, requests: list[EncodedRequest], point: BenchmarkPoint,
                    burstiness: float = 1.0, seed: int = 0,
                    show_progress: bool = True) -> RunResult:
    with progress_bar(len(requests), point, show_progress) as progress:
        async def one(request: EncodedRequest) -> list[RequestResult]:
            result = await client.send(request)
            progress.update(1)
            return [result]

        return await run_jobs([partial(one, r) for r in requests], point, burstiness, seed)


async def run_jobs(jobs: Sequence[Job], point: BenchmarkPoint, burstiness: float = 1.0,
                   seed: int = 0) -> RunResult:
    """Starts each job at its arrival time; a job holds a concurrency slot until it ends."""
    offsets = arrival_offsets(len(jobs), point.request_rate, burstiness, seed)
    slots = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None

    async def start(job: Job) -> list[RequestResult]:
        if slots is None:
            return await job()
        async with slots:
            return await job()

    clock = time.perf_counter
    cpu_start, start_time = time.process_time(), clock()
    tasks = []
    for offset, job in zip(offsets, jobs, strict=True):
        delay = start_time + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(start(job)))
    results = [r for job_results in await asyncio.gather(*tasks) for r in job_results]
    duration, cpu = clock() - start_time, time.process_time() - cpu_start
    return RunResult(point, results, duration, cpu)
