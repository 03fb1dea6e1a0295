"""GPTQ and AWQ 4-bit checkpoints (W4A16): per linear qweight, qzeros and scales (GPTQ adds
g_idx), read into one Int4Weight layout. A CUDA device runs them with the Triton W4A16 GEMM;
elsewhere they are dequantized once at load to dense weights of the model dtype, and an fp32
model's small batches read the same values as 4-bit GGUF Q4_1 blocks (Int4Weight.to_q4_1).

GPTQ: qweight [K/8, N] packed along K, qzeros [G, N/8] along N, both in sequential order;
`checkpoint_format` "gptq" (v1, AutoGPTQ's) stores each zero point minus one, "gptq_v2" as is.
sym checkpoints store zero 8 like any other, so one path serves both. desc_act (act-order)
permutes which group each input row belongs to: g_idx says, and the references follow it.
AWQ (GEMM version): qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ_ORDER.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from services.worker.models.checkpoint_quant.int4_packing import (
    AWQ_ORDER, CODES_PER_WORD, pack_rows, unpack_cols)
from services.worker.models.checkpoint_quant.int4_weight import Int4Weight
from services.worker.models.checkpoint_quant.scheme import (
    CheckpointQuant, LinearLike, StoredTensors, UnsupportedQuantizationError, log_once)
from services.worker.models.layers import Linear


@dataclass(frozen=True)
class Int4Quant(CheckpointQuant):
    """What GPTQ and AWQ share: tensor names, the dense path, the CUDA kernel."""
    group_size: int | None      # input rows per group; None: one group (group_size -1)

    def is_quantized(self, weights: StoredTensors, name: str) -> bool:
        return name.endswith(".weight") and weights.has_stored(_prefix(name) + ".qweight")

    def dequantize(self, weights: StoredTensors, name: str) -> torch.Tensor:
        return self.int4_weight(weights, _prefix(name)).dequantize()

    def _stored_linear(self, weights: StoredTensors, names: list[str],
                       bias: torch.Tensor | None,
                       kernels: ModuleType | None) -> LinearLike | None:
        weight = Int4Weight.cat([self.int4_weight(weights, _prefix(n)) for n in names])
        if weight is None:
            log_once(f"{self.method}: fused weights with different g_idx run dequantized")
            return None
        if weights.device.type == "cuda":
            from services.worker.models.checkpoint_quant.w4a16_linear import W4A16Linear
            return W4A16Linear(weight, bias)
        # NOTE: Linear keeps the blocks only where they expand to the dense weight bit for
        # bit and the CPU kernel is there (fp32 batches up to max_block_rows).
        blocks = weight.to_q4_1() if weights.dtype == torch.float32 else None
        linear = Linear(weight.dequantize().to(weights.dtype), bias, blocks, kernels)
        log_once(f"{self.method} checkpoint: weights dequantized at load to {weights.dtype} "
                 f"on {weights.device.type}"
                 + ("; small batches read them as 4-bit blocks" if linear.quantized else ""))
        return linear

    @abstractmethod
    def int4_weight(self, weights: StoredTensors, prefix: str) -> Int4Weight:
        """The linear `prefix`'s weight (its checkpoint tensors are `prefix`.qweight ...)."""

    def _checked(self, prefix: str, qweight: torch.Tensor, zeros: torch.Tensor,
                 scales: torch.Tensor, g_idx: torch.Tensor | None) -> Int4Weight:
        """The Int4Weight, with g_idx made from group_size where the checkpoint has none."""
        num_rows = qweight.shape[0] * CODES_PER_WORD
        if g_idx is None:
            rows = torch.arange(num_rows, dtype=torch.int32, device=qweight.device)
            g_idx = rows // (self.group_size or num_rows)
        g_idx = g_idx.to(torch.int32)
        if (zeros.shape != scales.shape or scales.shape[1] != qweight.shape[1]
                or g_idx.shape != (num_rows,) or int(g_idx.max()) >= scales.shape[0]):
            raise ValueError(f"{self.method} tensors of {prefix} do not fit together: qweight "
                             f"{list(qweight.shape)}, zeros {list(zeros.shape)}, scales "
                             f"{list(scales.shape)}, g_idx up to {int(g_idx.max())}")
        return Int4Weight(qweight, zeros.to(torch.uint8), scales, g_idx)


@dataclass(frozen=True)
class GPTQQuant(Int4Quant):
    method = "gptq"
    desc_act: bool
    zero_offset: int            # 1 for "gptq" (v1 stores zero - 1), 0 for "gptq_v2"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQQuant:
        _check_bits(config, "gptq")
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantizationError(
                f"gptq checkpoint_format {checkpoint_format!r} (supported: gptq, gptq_v2)")
        return cls(_group_size(config), bool(config.get("desc_act", False)),
                   1 if checkpoint_format == "gptq" else 0)

    def int4_weight(self, weights: StoredTensors, prefix: str) -> Int4Weight:
        qweight = weights.get_stored(prefix + ".qweight")
        # NOTE: v1's zero - 1 wraps a zero point of 0 to 15: the mask undoes that too.
        zeros = (unpack_cols(weights.get_stored(prefix + ".qzeros"))[:, :qweight.shape[1]]
                 + self.zero_offset) & 0xF
        g_idx = None
        if weights.has_stored(prefix + ".g_idx"):
            g_idx = weights.get_stored(prefix + ".g_idx")
        elif self.desc_act:
            raise ValueError(f"gptq desc_act checkpoint without {prefix}.g_idx")
        return self._checked(prefix, qweight, zeros, weights.get_stored(prefix + ".scales"),
                             g_idx)


@dataclass(frozen=True)
class AWQQuant(Int4Quant):
    method = "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQQuant:
        _check_bits(config, "awq")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantizationError(f"awq version {version!r} (supported: gemm)")
        if not config.get("zero_point", True):
            raise UnsupportedQuantizationError("awq without zero points (zero_point false)")
        return cls(_group_size(config))

    def int4_weight(self, weights: StoredTensors, prefix: str) -> Int4Weight:
        codes = unpack_cols(weights.get_stored(prefix + ".qweight"), AWQ_ORDER)   # [K, N]
        zeros = unpack_cols(weights.get_stored(prefix + ".qzeros"), AWQ_ORDER)
        return self._checked(prefix, pack_rows(codes), zeros,
                             weights.get_stored(prefix + ".scales"), None)


def _prefix(name: str) -> str:
    return name.removesuffix(".weight")


def _check_bits(config: dict[str, Any], method: str) -> None:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise UnsupportedQuantizationError(f"{method} with bits {bits!r} (supported: 4)")


def _group_size(config: dict[str, Any]) -> int | None:
    size = int(config.get("group_size", config.get("q_group_size", -1)))
    return None if size == -1 else size
