"""Times the CPU paged attention kernel on one prompt chunk: `python -m benchmarks.prefill_attention`.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64): one request whose chunk of
new tokens attends to a cached prefix and to itself, as a prefill step's layer does. For each
(prefix, new tokens) pair and dtype, the median ms of one layer's attention (the cache write
included) over --repeats calls. A bf16 chunk runs in bf16 products where the CPU has them (AMX
tiles, or AVX512-BF16 vectors: kernels/cpu/attention_prefill_bf16.cpp); fp32, and bf16 on
other CPUs, on fp32 FMAs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.harness import markdown_table, print_preamble
from services.worker.attention.backend import KVCache
from services.worker.attention.cpu_attn import CpuAttentionBackend
from services.worker.runner.cpu_runtime import configure_cpu_runtime
from tests.worker.attention_cases import BLOCK_SIZE, AttentionCase, make_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def time_chunk(prefix: int, new: int, dtype: torch.dtype, repeats: int) -> float:
    case = AttentionCase("chunk", NUM_HEADS, NUM_KV_HEADS, [prefix], [new], dtype=dtype,
                         head_dim=HEAD_DIM)
    step = make_step(case)
    backend = CpuAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5,
                                  BLOCK_SIZE)
    kv_cache = KVCache(step.key_cache, step.value_cache, k_scale_tensor=torch.ones(1),
                       v_scale_tensor=torch.ones(1))
    metadata = backend.build_metadata(step.common)
    samples = []
    for _ in range(repeats + 2):   # two warm-ups
        started = time.perf_counter()
        backend.forward(step.query, step.key, step.value, kv_cache, metadata)
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples[2:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="0x128,1920x128,3000x400",
                        help="PREFIXxNEW pairs: cached tokens before the chunk, its tokens")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args(argv)
    print_preamble()
    configure_cpu_runtime(None)
    chunks = [tuple(int(x) for x in pair.split("x")) for pair in args.chunks.split(",")]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    rows = [[f"{prefix} + {new}"] + [f"{time_chunk(prefix, new, dtype, args.repeats):.3f}"
                                     for dtype in dtypes]
            for prefix, new in chunks]
    header = ["prefix + new tokens"] + [f"{name} ms a layer" for name in args.dtypes.split(",")]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
