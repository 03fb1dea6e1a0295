"""W8A8 int8 linears for the CPU worker (--quantization int8).

Weights: per output channel, symmetric: s_w = max|w_row| / 127, q_w = round(w / s_w), made
once at load from the fp32 checkpoint values (the same int8 weights whatever --dtype is).
Activations: per token (row), the same rule, at every call. The product runs in int8 with
int32 accumulation; y = acc * s_x[row] * s_w[col] (+ b) in fp32, rounded once to the model's
dtype. Everything outside the linears (embedding, norms, attention, rope) stays in that dtype.

The two passes around the GEMM are C++ kernels (kernels/cpu/quant_int8.cpp); as torch ops they
would cost ~5 small ops each, ~10 us apiece at every one of a step's ~120 linears. Int8Ops
below is their reference, and the path where the kernels cannot be built.
"""

from __future__ import annotations

import functools
from types import ModuleType

import structlog
import torch

log = structlog.get_logger(__name__)

QUANTIZATIONS = ("none", "int8")


def check_quantization(quantization: str, device: str) -> None:
    """A clear error for a name we do not know, or int8 where it cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {quantization!r} (choose from "
                         f"{', '.join(QUANTIZATIONS)})")
    if quantization == "int8" and device not in ("cpu", "auto"):
        raise ValueError(f"--quantization int8 runs on the CPU only (--device {device}); "
                         f"on an accelerator use --quantization none")


class Int8Ops:
    """quantize_per_token / dequantize_int32 in torch: what the C++ kernels compute, bit for
    bit (same roundings in the same order)."""

    @staticmethod
    def quantize_per_token(x: torch.Tensor,
                           zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [M, K], scales [M] fp32): int8 q, or q + 128 as uint8 with zero_point 128."""
        xf = x.float()
        scales = xf.abs().amax(dim=1) / 127
        divisor = torch.where(scales == 0, 1.0, scales)[:, None]
        q = torch.round((xf / divisor).clamp_(-127, 127)).add_(zero_point)
        return q.to(torch.uint8 if zero_point else torch.int8), scales

    @staticmethod
    def dequantize_int32(acc: torch.Tensor, x_scales: torch.Tensor, w_scales: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        y = acc.float() * x_scales[:, None] * w_scales
        return (y if bias is None else y + bias).to(out_dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q_w int8 [N, K], s_w fp32 [N]): per output channel, symmetric."""
    return Int8Ops.quantize_per_token(weight.float())


class Int8Linear:
    """y = x W^T (+ b) with W in int8 per channel and x quantized per token at each call: the
    call interface of layers.Linear.

    NOTE: the GEMM is oneDNN's int8 linear on a weight packed once at load (what inductor's
    x86 int8 path calls), fed uint8 codes (q + 128, zero point 128: fed int8 codes it falls to
    a path >100x slower here). Its fp32 output is float(acc), the int32 sum, which
    dequantize_int32 scales.
    Measured (AMD EPYC, AVX-512 VNNI, no AMX, 2 threads, weights read from memory as in a
    step) against torch._int_mm, which works at every M (1..512) and any K, N but repacks the
    weight on each call: lm_head 576 -> 49152 at M = 8 / 32: 0.70 / 1.54 ms against 1.44 /
    2.05 ([K, N] contiguous; [N, K] passed transposed is slower still, but for a GEMV at
    M = 1); gate_up 576 -> 3072: 0.063 / 0.115 against 0.090 / 0.131. _int_mm on the [N, K]
    weight is the fallback where this torch build has no oneDNN int8 linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernels: ModuleType | None = None, weight_scales: torch.Tensor | None = None):
        """weight_scales: `weight` holds int8 codes already, with these fp32 scales per
        output channel (a checkpoint stored W8A8: checkpoint_quant/compressed_tensors.py)."""
        if weight.device.type != "cpu":
            raise ValueError(f"--quantization int8 runs on the CPU only (the weights are on "
                             f"{weight.device.type})")
        self.out_features, self.in_features = weight.shape
        self.weight: torch.Tensor | None
        self.weight, self.weight_scales = (quantize_weight(weight) if weight_scales is None
                                           else (weight, weight_scales))
        self.bias = None if bias is None else bias.float()
        self.ops = kernels if kernels is not None else Int8Ops
        self.num_bytes = sum(t.numel() * t.element_size()
                             for t in (self.weight, self.weight_scales, self.bias)
                             if t is not None)
        self.num_bytes_per_small_batch = self.num_bytes   # no GGUF blocks (layers.Linear)
        self._packed = _try_onednn_pack(self.weight)
        if self._packed is not None:
            self.weight = None  # the packed copy replaces it: don't hold both
            self._ones = torch.ones(self.out_features)
            self._zeros = torch.zeros(self.out_features, dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            x_q, x_scales = self.ops.quantize_per_token(x, 0)
            acc = torch._int_mm(x_q, self.weight.t())
        else:
            x_q, x_scales = self.ops.quantize_per_token(x, ONEDNN_ZERO_POINT)
            acc = _onednn_int8_mm(x_q, self._packed, self._ones, self._zeros)
        return self.ops.dequantize_int32(acc, x_scales, self.weight_scales, self.bias, x.dtype)


ONEDNN_ZERO_POINT = 128


def _onednn_int8_mm(x_codes: torch.Tensor, packed: torch.Tensor, ones: torch.Tensor,
                    zeros: torch.Tensor) -> torch.Tensor:
    """float(q_x @ q_w^T) for codes q_x + 128 (uint8): unit scales, fp32 out."""
    return torch.ops.onednn.qlinear_pointwise(x_codes, 1.0, ONEDNN_ZERO_POINT, packed, ones,
                                              zeros, None, 1.0, 0, torch.float32, "none", [],
                                              "")


def _try_onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The int8 weight [N, K] packed for oneDNN's int8 linear, or None where this torch build
    has none, or it disagrees with torch._int_mm on a probe (then: one warning)."""
    n, k = weight.shape
    probe = torch.randint(-127, 128, (2, k), dtype=torch.int8)
    problem = "disagrees with torch._int_mm"
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        got = _onednn_int8_mm((probe.int() + ONEDNN_ZERO_POINT).to(torch.uint8), packed,
                              torch.ones(n), torch.zeros(n, dtype=torch.int64))
        if torch.equal(got, torch._int_mm(probe, weight.t()).float()):
            return packed
    except (RuntimeError, AttributeError) as e:
        problem = f"fails: {e}"
    _warn_once(f"oneDNN's int8 linear {problem}; int8 products run torch._int_mm")
    return None


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
