"""Times the linears of one SmolLM2-135M step: `python -m benchmarks.quant_linear`.

Every matrix of the model's 30 layers (fused q/k/v, o, fused gate/up, down: Q4_1 blocks) and
its lm_head (Q8_0), random values in the real shapes, each with its own memory so a pass
reads the weights as a real step does. For each row count, the median ms of --repeats passes
through all of them, with the GGUF blocks expanded on the fly (`blocks`, kernels/cpu/
quant_linear.cpp) and with oneDNN on the dense weights packed at load (what Linear runs past
its max_block_rows), and the GFLOP/s each reaches. `--dtype bfloat16` times a bf16 model's
linears: bf16 activations, the blocks rounded to bf16 as expanded, oneDNN's bf16 GEMM (AMX or
AVX-512-bf16 where the CPU has them) and, on CPUs with AMX, the AMX tile kernel
(kernels/cpu/amx_linear.cpp) that a bf16 Linear runs there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.harness import markdown_table, print_preamble
from services.worker.models.quantized import PackedBlocks, QuantizedMatrix
from services.worker.runner.cpu_runtime import load_cpu_kernels
from tests.worker.test_quant_linear import random_blocks

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # (N, K) per layer
LM_HEAD = (49152, 576)
NUM_LAYERS = 30


def matrices() -> list[QuantizedMatrix]:
    mats = [random_blocks(n, k, "Q4_1", seed=i * 4 + j)
            for i in range(NUM_LAYERS) for j, (n, k) in enumerate(LAYER_SHAPES)]
    return mats + [random_blocks(*LM_HEAD, "Q8_0", seed=10_000)]


def time_pass(run: Callable[[int, torch.Tensor], torch.Tensor], shapes: list[tuple[int, int]],
              rows: int, repeats: int, dtype: torch.dtype) -> float:
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {k for _, k in shapes}}
    samples = []
    for _ in range(repeats + 1):   # the first pass warms up
        started = time.perf_counter()
        for i, (_, k) in enumerate(shapes):
            run(i, inputs[k])
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bf16 = dtype == torch.bfloat16
    print_preamble()
    ops = load_cpu_kernels()
    assert ops is not None and ops.quant_linear_supported(), "needs the C++ kernels"
    mats = matrices()
    shapes = [m.shape for m in mats]
    weights = [m.dequantize().to(dtype) for m in mats]
    onednn_packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    packed = [PackedBlocks.of(m, ops.vec_size, bf16=bf16) for m in mats]
    amx = bf16 and ops.amx_linear_supported()
    amx_packed = [ops.amx_pack_bf16(w) for w in weights] if amx else []
    del weights
    flops_per_row = 2 * sum(n * k for n, k in shapes)

    def blocks(i: int, x: torch.Tensor) -> torch.Tensor:
        return ops.quant_linear(x, packed[i].blocks, packed[i].q4, bf16).to(dtype)

    def onednn(i: int, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, onednn_packed[i], None, "none", [], "")

    def amx_tiles(i: int, x: torch.Tensor) -> torch.Tensor:
        return ops.amx_linear(x, amx_packed[i], shapes[i][0])

    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        gflops = flops_per_row * rows / 1e6
        row: list[object] = [rows]
        runs = [blocks, onednn] + ([amx_tiles] if amx else [])
        for run in runs:
            ms = time_pass(run, shapes, rows, args.repeats, dtype)
            row += [f"{ms:.1f}", f"{gflops / ms:.0f}"]
        table.append(row)
    header = ["rows", "blocks ms", "blocks GFLOP/s", "oneDNN ms", "oneDNN GFLOP/s"]
    print(markdown_table(header + (["AMX tiles ms", "AMX tiles GFLOP/s"] if amx else []),
                         table))


if __name__ == "__main__":
    main()
