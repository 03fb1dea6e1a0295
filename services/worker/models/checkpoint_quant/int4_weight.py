"""A 4-bit weight in the one layout the worker keeps, whichever format it came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.models.checkpoint_quant.int4_packing import unpack_rows
from services.worker.models.checkpoint_quant.reference import dequantize_int4
from services.worker.models.quantized import BLOCK, QuantizedMatrix


@dataclass(frozen=True)
class Int4Weight:
    """W [N, K]: codes packed along K as GPTQ does (qweight int32 [K/8, N]), one zero point
    and scale per group and output column (zeros uint8 [G, N], scales [G, N] in the
    checkpoint's dtype) and each input row's group (g_idx int32 [K]: act-order checkpoints
    permute the groups, the rest have k // group_size)."""
    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.zeros, self.scales, self.g_idx))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return dequantize_int4(self.qweight, self.zeros, self.scales, self.g_idx)

    def to_q4_1(self) -> QuantizedMatrix | None:
        """The same values as GGUF Q4_1 blocks (w = d * q + m, 32 input rows a block), for
        the CPU's small-batch kernel (quantized.py); None unless each block's rows share a
        group (group sizes that are multiples of 32, without act order).
        NOTE: d = s, m = -(z * s): d * q + m is dequantize()'s q * s - z * s, bit for bit."""
        num_rows, num_cols = self.g_idx.shape[0], self.qweight.shape[1]
        if num_rows % BLOCK:
            return None
        block_groups = self.g_idx.view(-1, BLOCK)
        if not torch.equal(block_groups, block_groups[:, :1].expand_as(block_groups)):
            return None
        groups = block_groups[:, 0].long()
        scales = self.scales[groups].float().t().contiguous()            # [N, K/32]
        mins = -(self.zeros[groups].float().t() * scales)
        # GGUF's nibble order: byte i of a block holds rows i (low) and i + 16 (high).
        codes = unpack_rows(self.qweight).t().reshape(num_cols, -1, 2, BLOCK // 2)
        quants = (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8)
        return QuantizedMatrix(scales, mins.contiguous(),
                               quants.reshape(num_cols, -1).contiguous())

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight | None:
        """The parts stacked along N (q/k/v, gate/up); None unless they group their input
        rows alike (one g_idx for the fused weight)."""
        if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts[1:]):
            return None
        return Int4Weight(*(torch.cat(ts, dim=1) for ts in zip(
            *((p.qweight, p.zeros, p.scales) for p in parts))), parts[0].g_idx)
