"""A GGUF model's quantized blocks, for the fp32 model's linears.

The embedded model ships as GGUF (Q4_1 layers, a Q8_0 embedding) and the worker loads its
dequantized fp32 values. A decode step at small batch is bound by reading those weights
(538 MB a step); the same values, kept as their GGUF blocks and expanded on the fly by
kernels/cpu/quant_linear.cpp, are ~5x fewer bytes (and its GEMM beats oneDNN's on the dense
weights up to a few hundred rows on AVX2). The products are the fp32 model's: a
matrix is used only where expanding its blocks gives the loaded fp32 weight bit for bit
(Linear checks), so greedy output is the fp32 model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.gguf_blocks import BLOCKS_FILE

BLOCK = 32


@dataclass(frozen=True)
class QuantizedMatrix:
    """W [N, K] as GGUF blocks along K: scales (and Q4_1 mins) [N, K/32] fp32, quants uint8
    ([N, K/2] nibbles for Q4_1, [N, K] int8 for Q8_0)."""
    scales: torch.Tensor
    mins: torch.Tensor          # empty for Q8_0
    quants: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.scales, self.mins, self.quants))

    def dequantize(self) -> torch.Tensor:
        """The fp32 values, as gguf's dequantizer computes them: (d * q) + m, d * q."""
        n, num_blocks = self.scales.shape
        if self.mins.numel():
            q = self.quants.view(n, num_blocks, BLOCK // 2)
            q = torch.cat([q & 0x0F, q >> 4], dim=2).float()
            return (self.scales[:, :, None] * q + self.mins[:, :, None]).reshape(n, -1)
        q = self.quants.view(torch.int8).view(n, num_blocks, BLOCK).float()
        return (self.scales[:, :, None] * q).reshape(n, -1)

    def rows(self, index: torch.Tensor) -> QuantizedMatrix:
        """The matrix of the rows `index` of this one."""
        return QuantizedMatrix(self.scales[index],
                               self.mins[index] if self.mins.numel() else self.mins,
                               self.quants[index])

    @staticmethod
    def cat(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
        return QuantizedMatrix(*(torch.cat(ts) for ts in zip(
            *((p.scales, p.mins, p.quants) for p in parts))))


@dataclass(frozen=True)
class PackedBlocks:
    """A QuantizedMatrix in the layout kernels/cpu/quant_linear.cpp reads: W's columns in
    groups of G (the kernels' vector width), each group's blocks of 32 k in order, a block
    the G scales (fp32), Q4_1's G mins, then the codes of its 32 k with the group's columns
    side by side at each k (Q4_1: G/2 bytes, column 2j in the low nibble of byte j, 2j + 1 in
    the high one; Q8_0: G int8). So a group's weights at one k expand from one load, and a
    group is one stream in memory. `blocks` is uint8 [N/G, K/32, bytes a block]; `bf16`: the
    kernel rounds each expanded weight to bf16 (a bf16 model's weights)."""
    blocks: torch.Tensor
    q4: bool
    bf16: bool = False

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel()

    @staticmethod
    def fits(matrix: QuantizedMatrix, group: int) -> bool:
        """Whether the kernel can read `matrix`: its columns fill groups of `group`, and
        (Q4_1) each scale times a 4-bit code is exact in fp32, so the kernel's fused
        d * q + m rounds as gguf's d * q, then + m does. GGUF's fp16 scales always are."""
        if matrix.scales.shape[0] % group or group % 2:
            return False
        mantissa = matrix.scales.view(torch.int32) & 0x7FFFFF
        return not matrix.mins.numel() or not bool((mantissa & 0xF).any())

    @staticmethod
    def of(matrix: QuantizedMatrix, group: int, bf16: bool = False) -> PackedBlocks:
        if not PackedBlocks.fits(matrix, group):
            raise ValueError("these blocks do not fit the kernel (see PackedBlocks.fits)")
        n, num_blocks = matrix.scales.shape

        def by_group(t: torch.Tensor) -> torch.Tensor:   # [N, K/32 * X] -> [N/G, K/32, X * G]
            per_block = t.reshape(n // group, group, num_blocks, -1).permute(0, 2, 3, 1)
            return per_block.reshape(n // group, num_blocks, -1)

        q4 = bool(matrix.mins.numel())
        if q4:
            packed = matrix.quants.view(n, num_blocks, BLOCK // 2)
            codes = by_group(torch.cat([packed & 0x0F, packed >> 4], dim=2))
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
            parts = [matrix.scales, matrix.mins]
        else:
            codes = by_group(matrix.quants)
            parts = [matrix.scales]
        floats = [by_group(p).contiguous().view(torch.uint8) for p in parts]
        return PackedBlocks(torch.cat([*floats, codes], dim=2).contiguous(), q4, bf16)


class BlockSource:
    """The quantized blocks saved beside a converted GGUF model (services/common/gguf_blocks.py),
    by HF weight name."""

    def __init__(self, path: Path):
        self._file = safe_open(str(path), framework="pt")
        self._names = set(self._file.keys())

    @classmethod
    def of_model_dir(cls, model_dir: Path) -> BlockSource | None:
        path = model_dir / BLOCKS_FILE
        return cls(path) if path.is_file() else None

    def get_fused(self, names: list[str]) -> QuantizedMatrix | None:
        """The named weights concatenated along N (q/k/v, gate/up); None unless every one
        has blocks of the same format."""
        if not all(f"{name}.scales" in self._names for name in names):
            return None
        parts = [self._get(name) for name in names]
        if len({bool(p.mins.numel()) for p in parts}) != 1:
            return None
        return QuantizedMatrix.cat(parts)

    def _get(self, name: str) -> QuantizedMatrix:
        mins = (self._file.get_tensor(f"{name}.mins") if f"{name}.mins" in self._names
                else torch.empty(0))
        return QuantizedMatrix(self._file.get_tensor(f"{name}.scales"), mins,
                               self._file.get_tensor(f"{name}.quants"))
