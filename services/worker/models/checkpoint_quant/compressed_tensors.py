"""compressed-tensors checkpoints (llm-compressor's output) with 8-bit weights.

int-quantized: each linear's `weight` is int8 [N, K] with `weight_scale` per output channel
([N, 1]) or per tensor, symmetric. With dynamic per-token int8 activations (W8A8) the CPU runs
it as the Int8Linear of --quantization int8 (int8.py) built from these codes and scales: the
same product the format defines. Without activation quantization (W8A16), and on other
devices, the weight is dequantized at load.
float-quantized: `weight` is FP8 e4m3 with a per-channel or per-tensor `weight_scale`; it is
dequantized at load to the model dtype and activations run unquantized (reference.fp8_linear
is the format's own product). A static `input_scale` is then unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from services.worker.models.checkpoint_quant.scheme import (
    CheckpointQuant, LinearLike, StoredTensors, UnsupportedQuantizationError)
from services.worker.models.int8 import Int8Linear

_FORMAT_TO_TYPE = {"int-quantized": "int", "float-quantized": "float"}
_STORED_DTYPE = {"int": torch.int8, "float": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CompressedTensorsQuant(CheckpointQuant):
    method = "compressed-tensors"
    weight_type: str                    # "int" | "float"
    has_dynamic_token_activations: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsQuant:
        fmt = config.get("format")
        if fmt not in _FORMAT_TO_TYPE:
            raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r}")
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1 or "Linear" not in groups[0].get("targets", []):
            raise UnsupportedQuantizationError(
                "compressed-tensors with other than one config group targeting Linear")
        weight_type = _FORMAT_TO_TYPE[fmt]
        _check_weights(groups[0].get("weights") or {}, weight_type)
        activations = groups[0].get("input_activations")
        return cls(weight_type, _has_dynamic_token_activations(activations, weight_type))

    def is_quantized(self, weights: StoredTensors, name: str) -> bool:
        return name.endswith(".weight") and weights.has_stored(_scale_name(name))

    def dequantize(self, weights: StoredTensors, name: str) -> torch.Tensor:
        codes, scales = self._codes_and_scales(weights, name)
        return codes.float() * scales[:, None]

    def _stored_linear(self, weights: StoredTensors, names: list[str],
                       bias: torch.Tensor | None,
                       kernels: ModuleType | None) -> LinearLike | None:
        if (self.weight_type != "int" or not self.has_dynamic_token_activations
                or weights.device.type != "cpu"):
            return None
        codes, scales = (torch.cat(parts) for parts in zip(
            *(self._codes_and_scales(weights, n) for n in names)))
        return Int8Linear(codes, bias, kernels, weight_scales=scales)

    def _codes_and_scales(self, weights: StoredTensors,
                          name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored codes [N, K] and fp32 scales [N] (a per-tensor scale repeated)."""
        codes = weights.get_stored(name)
        if codes.dtype != _STORED_DTYPE[self.weight_type]:
            raise ValueError(f"{name} is {codes.dtype}; a compressed-tensors "
                             f"{self.weight_type} checkpoint stores "
                             f"{_STORED_DTYPE[self.weight_type]}")
        scale = weights.get_stored(_scale_name(name)).float().reshape(-1)
        if scale.numel() not in (1, codes.shape[0]):
            raise ValueError(f"{_scale_name(name)} has {scale.numel()} values for "
                             f"{codes.shape[0]} output channels")
        return codes, scale.expand(codes.shape[0]).contiguous()


def _scale_name(name: str) -> str:
    return name.removesuffix("weight") + "weight_scale"


def _check_weights(scheme: dict[str, Any], weight_type: str) -> None:
    if (scheme.get("type") != weight_type or scheme.get("num_bits") != 8
            or not scheme.get("symmetric", True) or scheme.get("dynamic")
            or scheme.get("strategy") not in ("channel", "tensor")):
        raise UnsupportedQuantizationError(f"compressed-tensors weights {scheme}")


def _has_dynamic_token_activations(scheme: dict[str, Any] | None, weight_type: str) -> bool:
    """True for dynamic per-token 8-bit activations, False for none (or, FP8 only, what a
    dequantized weight leaves unused: static per-tensor)."""
    if scheme is None:
        return False
    dynamic_token = (scheme.get("dynamic") is True and scheme.get("strategy") == "token"
                     and scheme.get("symmetric", True))
    static_tensor = scheme.get("dynamic") is False and scheme.get("strategy") == "tensor"
    if (scheme.get("type") != weight_type or scheme.get("num_bits") != 8
            or not (dynamic_token or (weight_type == "float" and static_tensor))):
        raise UnsupportedQuantizationError(f"compressed-tensors input activations {scheme}")
    return dynamic_token
