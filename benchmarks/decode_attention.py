"""Times the CPU paged decode attention kernel alone: `python -m benchmarks.decode_attention`.

One decode step's attention over SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim
64, 30 layers, each with its own cache, so the KV is read from memory as in a real step), for
each block size and block layout: `contiguous` (a request's blocks in order, as a fresh
engine hands them out) and `scattered` (a random permutation of the cache, as after hours of
allocations and frees). Prints the median of --repeats passes over the 30 layers and the KV
read rate it implies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import markdown_table, print_preamble
from kernels import cpu_ops
from services.worker.cpu_runtime import cpu_kernels_dir, load_cpu_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 30
SPARE_BLOCKS = 64   # the cache holds more than the step reads, so a layout has room to spread


def time_step(ops, batch: int, context: int, block_size: int, layout: str,  # noqa: ANN001
              dtype: torch.dtype, repeats: int) -> float:
    """Median ms of one step's attention (every layer), one decode token per request."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_request = -(-context // block_size)
    num_blocks = batch * blocks_per_request + SPARE_BLOCKS
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen).to(dtype),
               torch.randn(shape, generator=gen).to(dtype)) for _ in range(NUM_LAYERS)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="decode rows in the step")
    parser.add_argument("--context", type=int, default=576, help="tokens each row attends to")
    parser.add_argument("--block-sizes", default="16,64,128")
    parser.add_argument("--layouts", default="contiguous,scattered")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
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
                ms = time_step(ops, args.batch, args.context, block_size, layout, dtype,
                               args.repeats)
                kv_bytes = (2 * NUM_LAYERS * args.batch * args.context * NUM_KV_HEADS
                            * HEAD_DIM * dtype.itemsize)
                rows.append([dtype_name, block_size, layout, f"{ms:.2f}",
                             f"{kv_bytes / ms / 1e6:.1f}"])
                print(" ".join(map(str, rows[-1])), flush=True)
    print(f"\n{args.batch} decode rows x {args.context} tokens, {NUM_LAYERS} layers, "
          f"{torch.get_num_threads()} threads\n")
    print(markdown_table(["dtype", "block size", "layout", "ms per step", "KV GB/s"], rows))


if __name__ == "__main__":
    main()
