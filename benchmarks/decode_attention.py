"""Times the CPU paged decode attention kernel alone: `python -m benchmarks.decode_attention`.

One decode step's attention over SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim
64, 30 layers, each with its own cache, so the KV is read from memory as in a real step), for each block
size, block layout — `contiguous` (a request's blocks in order, as a fresh engine hands them
out) or `scattered` (a random permutation of the cache, as after hours of allocations and
frees) — and pages: `huge` (the worker's allocation, services/worker/kv/kv_cache.py, which
asks for transparent huge pages) or `4k` (a plain tensor). Prints the median of --repeats
passes over the 30 layers and the KV read rate it implies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.harness import markdown_table, print_preamble
from kernels import cpu_ops
from services.worker.kv.kv_cache import KVCacheSpec, allocate_kv_caches
from services.worker.runner.cpu_runtime import cpu_kernels_dir, load_cpu_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 30
SPARE_BLOCKS = 64   # the cache holds more than the step reads, so a layout has room to spread


def make_caches(num_blocks: int, block_size: int, dtype: torch.dtype, pages: str,
                gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (key, value) cache, random values written in (a page never written
    would be the kernel's shared zero page, always in cache)."""
    spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, block_size, dtype)
    if pages == "huge":
        caches = [(c.key, c.value)
                  for c in allocate_kv_caches(spec, num_blocks, torch.device("cpu"))]
    else:
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        caches = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
                  for _ in range(NUM_LAYERS)]
    for key, value in caches:
        key.copy_(torch.randn(key.shape, generator=gen))
        value.copy_(torch.randn(value.shape, generator=gen))
    return caches


def time_step(ops, batch: int, context: int, block_size: int, layout: str,  # noqa: ANN001
              pages: str, dtype: torch.dtype, repeats: int) -> float:
    """Median ms of one step's attention (every layer), one decode token per request."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_request = -(-context // block_size)
    num_blocks = batch * blocks_per_request + SPARE_BLOCKS
    caches = make_caches(num_blocks, block_size, dtype, pages, gen)
    used = batch * blocks_per_request
    blocks = (torch.arange(1, used + 1) if layout == "contiguous"
              else torch.randperm(num_blocks - 1, generator=gen)[:used] + 1)
    block_table = blocks.view(batch, blocks_per_request).to(torch.int32).contiguous()
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty(batch, NUM_HEADS * HEAD_DIM, dtype=dtype)
    plan = ops.attention_plan(torch.arange(batch + 1, dtype=torch.int32),
                              torch.full((batch,), context, dtype=torch.int32),
                              NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, 0)

    def step() -> None:
        for key_cache, value_cache in caches:
            ops.paged_attention(out, query, key_cache, value_cache, block_table, *plan,
                                HEAD_DIM ** -0.5, 1.0, 1.0, 0, 0.0)

    step()   # first touch of every page, and the kernels' first call
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1000


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="decode rows in the step")
    parser.add_argument("--context", type=int, default=576, help="tokens each row attends to")
    parser.add_argument("--block-sizes", default="16,64,128")
    parser.add_argument("--layouts", default="contiguous,scattered")
    parser.add_argument("--pages", default="huge,4k")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print_preamble()
    ops = load_cpu_kernels()
    if ops is None:
        raise SystemExit("the CPU kernels are unavailable: "
                         f"{cpu_ops.unavailable_reason(cpu_kernels_dir())}")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for block_size in map(int, args.block_sizes.split(",")):
            for layout in args.layouts.split(","):
                for pages in args.pages.split(","):
                    ms = time_step(ops, args.batch, args.context, block_size, layout, pages,
                                   dtype, args.repeats)
                    kv_bytes = (2 * NUM_LAYERS * args.batch * args.context * NUM_KV_HEADS
                                * HEAD_DIM * dtype.itemsize)
                    rows.append([dtype_name, block_size, layout, pages, f"{ms:.2f}",
                                 f"{kv_bytes / ms / 1e6:.1f}"])
                    print(" ".join(map(str, rows[-1])), flush=True)
    print(f"\n{args.batch} decode rows x {args.context} tokens, {NUM_LAYERS} layers, "
          f"{torch.get_num_threads()} threads\n")
    print(markdown_table(["dtype", "block size", "layout", "pages", "ms per step",
                          "KV GB/s"], rows))


if __name__ == "__main__":
    main()
