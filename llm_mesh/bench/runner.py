"""Runs one benchmark point: requests arrive at a rate (Poisson, or gamma for burstiness),
each waits for a slot under an optional concurrency cap, and all stream concurrently.

Arrival times are drawn up front and slept to from the start, so a slow send never
shifts later arrivals (no drift), and the draw is seeded for repeatable runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from llm_mesh.bench.openai_client import EncodedRequest, OpenAIClient
from llm_mesh.bench.stream_parser import RequestResult


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
    """Seconds from the start at which each request is sent."""
    if math.isinf(rate):
        return np.zeros(num)
    # Gamma inter-arrivals with shape k and mean 1/rate: k=1 is Poisson, k<1 burstier.
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)


async def run_point(client: OpenAIClient, requests: list[EncodedRequest], point: BenchmarkPoint,
                    burstiness: float = 1.0, seed: int = 0,
                    show_progress: bool = True) -> RunResult:
    offsets = arrival_offsets(len(requests), point.request_rate, burstiness, seed)
    slots = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
    progress = tqdm(total=len(requests), desc=point.label, unit="req", leave=False,
                    disable=not show_progress)

    async def one(request: EncodedRequest) -> RequestResult:
        if slots is None:
            result = await client.send(request)
        else:
            async with slots:
                result = await client.send(request)
        progress.update(1)
        return result

    clock = time.perf_counter
    cpu_start, start = time.process_time(), clock()
    tasks = []
    for offset, request in zip(offsets, requests, strict=True):
        delay = start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = list(await asyncio.gather(*tasks))
    duration, cpu = clock() - start, time.process_time() - cpu_start
    progress.close()
    return RunResult(point, results, duration, cpu)
