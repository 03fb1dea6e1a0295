"""What a quantized checkpoint's scheme answers for the WeightSource and the model's linears."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from types import ModuleType
from typing import Protocol

import structlog
import torch

log = structlog.get_logger(__name__)

SUPPORTED = ("compressed-tensors int-quantized (int8 weights per channel or per tensor, "
             "activations dynamic per token or none), compressed-tensors float-quantized (FP8 "
             "e4m3 weights per channel or per tensor), gptq and awq (bits 4; awq: version gemm "
             "with zero points)")


class LinearLike(Protocol):
    """The call interface of layers.Linear."""
    num_bytes: int
    num_bytes_per_small_batch: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class StoredTensors(Protocol):
    """What a scheme reads from the checkpoint (weights.WeightSource)."""
    dtype: torch.dtype          # the model's
    device: torch.device

    def has_stored(self, name: str) -> bool: ...

    def get_stored(self, name: str) -> torch.Tensor: ...


class UnsupportedQuantizationError(ValueError):
    """A quantization_config the worker cannot load; the message names what it can."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; supported quantized checkpoints: {SUPPORTED}")


class CheckpointQuant(ABC):
    """How a checkpoint stores its quantized linears (read from the raw tensors), and which
    of them run in their quantized form on this device."""
    method: str

    @abstractmethod
    def is_quantized(self, weights: StoredTensors, name: str) -> bool:
        """Whether the linear weight `name` ("layers.0.mlp.up_proj.weight") is stored
        quantized (layers the checkpoint ignored are stored dense)."""

    @abstractmethod
    def dequantize(self, weights: StoredTensors, name: str) -> torch.Tensor:
        """The weight `name` as fp32 [out, in] (the torch reference of the format)."""

    def linear(self, weights: StoredTensors, names: list[str], bias: torch.Tensor | None,
               kernels: ModuleType | None, quantization: str = "none") -> LinearLike | None:
        """A linear running the fused weights `names` in their stored form, or None where they
        are stored dense or this device runs them dequantized (weights.WeightSource.get).
        quantization: --quantization, which a checkpoint stored quantized refuses."""
        if quantization != "none":
            raise ValueError(f"--quantization {quantization} with a checkpoint stored "
                             f"quantized ({self.method}): run it without the flag")
        if not all(self.is_quantized(weights, name) for name in names):
            return None
        stored = self._stored_linear(weights, names, bias, kernels)
        if stored is None:
            log_once(f"{self.method} checkpoint: weights dequantized at load to the model "
                     f"dtype on {weights.device.type} (activations are not quantized)")
        return stored

    def _stored_linear(self, weights: StoredTensors, names: list[str],
                       bias: torch.Tensor | None,
                       kernels: ModuleType | None) -> LinearLike | None:
        """The stored form's linear where this device has one (all `names` are quantized)."""
        return None


@functools.cache
def log_once(message: str) -> None:
    """Said once per process, not once per linear."""
    log.info(message)
