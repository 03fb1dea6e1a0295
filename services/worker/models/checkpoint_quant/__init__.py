"""Checkpoints users download already quantized: compressed-tensors W8A8 int8 and FP8, GPTQ and
AWQ 4-bit. config.json's quantization_config picks the scheme (config.py); the WeightSource
hands any linear weight stored quantized back dequantized (scheme.dequantize, the torch
reference), and the model asks the scheme for a linear that runs the stored form where this
device has one (W8A8 int8 on CPU: Int8Linear; W4A16 on CUDA: the Triton GEMM; W4A16 on CPU:
dense, with 4-bit blocks for small fp32 batches).
See docs/quantization.md."""

from services.worker.models.checkpoint_quant.config import (
    parse_quantization_config, read_checkpoint_quant)
from services.worker.models.checkpoint_quant.scheme import (
    CheckpointQuant, UnsupportedQuantizationError)

__all__ = ["CheckpointQuant", "UnsupportedQuantizationError", "parse_quantization_config",
           "read_checkpoint_quant"]
