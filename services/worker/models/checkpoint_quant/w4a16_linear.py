"""A GPTQ / AWQ linear kept 4-bit on a CUDA device: the Triton W4A16 GEMM at every call."""

from __future__ import annotations

import torch

from services.worker.models.checkpoint_quant.int4_weight import Int4Weight


class W4A16Linear:
    """y = x W^T (+ b) with W an Int4Weight: the call interface of layers.Linear."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        # NOTE: imported here: the CPU path never imports triton (kernels/__init__.py says why).
        from kernels.triton_w4a16 import w4a16_gemm
        self._gemm = w4a16_gemm
        self.weight = weight
        self.bias = bias
        self.in_features = weight.g_idx.shape[0]
        self.out_features = weight.qweight.shape[1]
        self.num_bytes = weight.num_bytes + (0 if bias is None
                                             else bias.numel() * bias.element_size())
        self.num_bytes_per_small_batch = self.num_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        y = self._gemm(x, w.qweight, w.zeros, w.scales, w.g_idx)
        return y if self.bias is None else y.add_(self.bias)
