"""Times the batched LoRA op on SmolLM2-135M's shapes: `python -m benchmarks.lora_ops`.

One decoder layer's four linears (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down
1536 -> 576), fp32, adapters of rank 16 on all seven projections, rows spread evenly over the
base and the step's adapters. Per case: the base linears alone, then the LoRA updates by the
CPU paths (ops.grouped_lora_add, ops.masked_lora_add) and the torch reference (ops.ref_lora_add),
per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks.harness import print_preamble
from services.worker.lora.ops import LoraBatch, grouped_lora_add, masked_lora_add, ref_lora_add
from services.worker.models.layers import Linear

RANK = 16
NUM_SLOTS = 4
# (in_features, out_features, projections fused in it)
LINEARS = [(576, 960, 3), (576, 576, 1), (576, 3072, 2), (1536, 576, 1)]
CASES = [   # (name, rows, adapters in the step; rows spread over them and the base)
    ("decode 32 rows, 4 adapters + base", 32, 4),
    ("decode 32 rows, 1 adapter", 32, 1),
    ("decode 8 rows, 4 adapters + base", 8, 4),
    ("chunk 64 rows, 4 adapters + base", 64, 4),
    ("chunk 128 rows, 4 adapters + base", 128, 4),
    ("prefill 512 rows, 4 adapters + base", 512, 4),
]


def _median_us(fn: Callable[[], None], repeat: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per path")
    args = parser.parse_args(argv)
    print_preamble()
    torch.manual_seed(0)
    layers = []
    for k, n, parts in LINEARS:
        rank = RANK * parts
        lora_b_by_out = torch.randn(n, NUM_SLOTS, rank)
        layers.append((Linear(torch.randn(n, k) * 0.02), torch.randn(NUM_SLOTS, rank, k),
                       lora_b_by_out.permute(1, 0, 2), [rank] * NUM_SLOTS, lora_b_by_out))
    scales = torch.ones(NUM_SLOTS)
    scale_list = scales.tolist()
    for name, rows, num_adapters in CASES:
        slots = (np.arange(rows) % (num_adapters + (num_adapters > 1))).astype(np.int32)
        slots[slots == num_adapters] = -1   # the base's share when the step mixes
        batch = LoraBatch.from_slots(slots, scale_list, torch.device("cpu"))
        # The masked path's scales for every case (the worker makes them up to 64 rows only).
        row_scales = torch.from_numpy(((slots[:, None] == np.arange(NUM_SLOTS))
                                       * scales.numpy())[:, :, None].astype(np.float32))
        xs = [torch.randn(rows, k) for k, _, _ in LINEARS]
        ys = [torch.zeros(rows, n) for _, n, _ in LINEARS]

        def base() -> None:
            for (linear, *_), x in zip(layers, xs):
                linear(x)

        def grouped() -> None:
            for (_, a, b, ranks, _), x, y in zip(layers, xs, ys):
                grouped_lora_add(y, x, a, b, scale_list, ranks, batch.groups)

        def masked() -> None:
            for (_, a, _, _, b_by_out), x, y in zip(layers, xs, ys):
                masked_lora_add(y, x, a.view(-1, a.shape[2]).t(),
                                b_by_out.view(b_by_out.shape[0], -1).t(), row_scales)

        def reference() -> None:
            for (_, a, b, _, _), x, y in zip(layers, xs, ys):
                ref_lora_add(y, x, a, b, scales, batch.token_slots)

        repeat = args.repeat
        print(f"{name}: base linears {_median_us(base, repeat):.0f} us; LoRA: grouped "
              f"{_median_us(grouped, repeat):.0f} us, masked {_median_us(masked, repeat):.0f} "
              f"us, reference {_median_us(reference, max(1, repeat // 10)):.0f} us (per layer)")


if __name__ == "__main__":
    main()
