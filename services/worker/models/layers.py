"""The linear layer the Llama family is built from (its small fused steps: layer_ops.py).

Layers are plain objects holding tensors, not nn.Modules: a decode step calls ~200 of them and
Module.__call__ costs microseconds each on the hot path.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType

import structlog
import torch
import torch.nn.functional as F

from services.worker.models.quantized import PackedBlocks, QuantizedMatrix

log = structlog.get_logger(__name__)

# Rows up to which a linear with GGUF blocks reads them instead of its dense weight.
# NOTE: every linear of a SmolLM2 step (2 cores, benchmarks/quant_linear.py, benchmarks.md
# 10g and 10h) against oneDNN on the dense fp32 weights: on AVX2 2.2-2.5x faster at 1-4
# rows, 1.34x at 32, 1.20x at 256, 1.08x at 512; on AVX-512 2.8-3.0x at 1-4, 1.67x at 32,
# 1.06x at 256, 0.87x at 512.
QUANTIZED_MAX_ROWS = 256
# The same where the CPU has a bf16 GEMM but no AMX (AVX-512-bf16) and the model is bf16:
# the blocks' bf16 products summed in pairs (quant_linear_bf16_dot_supported), else in fp32.
# NOTE: against oneDNN's bf16 GEMM on a Zen 4 EPYC, in pairs: 2.5x at 1 row, 1.7x at 4,
# 1.4x at 8 (benchmarks.md 10n); in fp32: 1.56x at 1 row, 1.12x at 4, 0.94x at 6, 0.83x at 8
# (10m).
QUANTIZED_MAX_ROWS_BF16_DOT = 8
QUANTIZED_MAX_ROWS_BF16_GEMM = 4
# Rows of each matrix whose GGUF blocks are checked against the loaded weight.
_SAMPLE_ROWS = 64


class Linear:
    """y = x W^T (+ b) for 2-D x, with W stored in the layout the device's GEMM reads fastest.

    NOTE: on CPU, oneDNN's blocked layout, packed once at load (what inductor's weight
    prepacking does). Measured (2 cores, AVX-512) over SmolLM2's 30 layers of weights, read
    from memory as in a real step: fp32 at 1 / 4 / 8 / 32 / 64 / 256 rows takes 0.91 / 0.36 /
    0.44 / 0.52 / 0.61 / 0.81x the time of MKL on a pre-transposed weight (x @ Wt), which
    itself beats F.linear; bf16 and fp16 gain 1.5-2x too (F.linear would re-layout the weight
    on every call). MKL's x @ Wt is the fallback where this torch build cannot prepack.
    On CUDA, F.linear (cuBLAS picks its own kernels).

    NOTE: a bf16 model on a CPU with AMX-BF16 runs kernels/cpu/amx_linear.cpp instead, at
    every batch size: against oneDNN's AMX GEMM on SmolLM2's linears (2 cores) 1.4x faster at
    1-32 rows, 1.2x at 64, even at 128, 0.84x at 256 (benchmarks.md 10j); the default step
    budget is 128 tokens.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 quantized: QuantizedMatrix | None = None, kernels: ModuleType | None = None):
        self.out_features, self.in_features = weight.shape
        self.num_bytes = sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.forward: Callable[[torch.Tensor], torch.Tensor] = self._dense
        # GGUF blocks of the same values (packed for the kernel), for batches of up to
        # max_block_rows rows.
        self.quantized: PackedBlocks | None = None
        self.max_block_rows = 0
        self._kernels = kernels
        self._bias_fp32 = None if bias is None else bias.float()
        # Whether silu_and_mul(x) may stand for SiLU-and-mul of this linear's output.
        self.fuses_silu_and_mul = False
        if weight.device.type != "cpu":
            return
        if weight.dtype == torch.float32:
            self._read_blocks(quantized, weight, kernels, QUANTIZED_MAX_ROWS)
        if (weight.dtype == torch.bfloat16 and kernels is not None
                and kernels.amx_linear_supported()):
            # NOTE: no GGUF blocks beside it: it reads the dense weights as fast at 1-2 rows
            # and faster from 4 (benchmarks.md 10j).
            self.amx_packed = kernels.amx_pack_bf16(weight)
            self.weight = None
            self.forward = self._amx
            self.fuses_silu_and_mul = bias is None and self.out_features % 32 == 0
            return
        self._packed = _try_prepack(weight, bias)
        if self._packed is not None:
            if weight.dtype == torch.bfloat16:
                in_pairs = kernels is not None and kernels.quant_linear_bf16_dot_supported()
                self._read_blocks(quantized, weight, kernels, QUANTIZED_MAX_ROWS_BF16_DOT
                                  if in_pairs else QUANTIZED_MAX_ROWS_BF16_GEMM)
            self.weight = None  # the packed copy replaces it: don't hold both
            self.forward = self._prepacked
            return
        if weight.dtype != torch.float32:
            # NOTE: a CPU without a 16-bit GEMM (no AVX-512 / AVX-NE-CONVERT) has oneDNN
            # refuse 16-bit packing and MKL crawl (bf16 SmolLM2: 411 ms a batch-1 step,
            # 5 prefill tokens/s). 16-bit values are exact in fp32, so multiplying there
            # keeps the products and accumulates in fp32, as a 16-bit GEMM does.
            self._packed = _try_prepack(weight.float(), self._bias_fp32)
            if self._packed is not None:
                _log_once(f"no {weight.dtype} GEMM on this CPU: 16-bit weights are multiplied "
                          f"in fp32 (the same products, fp32 accumulation; twice the bytes)")
                self._read_blocks(quantized, weight, kernels, QUANTIZED_MAX_ROWS)
                self.weight = None
                self.forward = self._prepacked_in_fp32
                self.num_bytes *= 2   # what a step reads now
                return
        self.weight_t = weight.t().contiguous()
        self.weight = None
        self.forward = self._transposed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.max_block_rows:
            return self._from_blocks(x)
        return self.forward(x)

    @property
    def num_bytes_per_small_batch(self) -> int:
        """Weight bytes a step of at most max_block_rows rows reads."""
        if self.quantized is None:
            return self.num_bytes
        return self.quantized.num_bytes + (0 if self.bias is None else
                                           self.bias.numel() * self.bias.element_size())

    def _read_blocks(self, quantized: QuantizedMatrix | None, weight: torch.Tensor,
                     kernels: ModuleType | None, max_rows: int) -> None:
        if quantized is not None and kernels is not None and _same_values(quantized, weight,
                                                                          kernels):
            self.quantized = PackedBlocks.of(quantized, kernels.vec_size,
                                             bf16=weight.dtype == torch.bfloat16)
            self.max_block_rows = max_rows

    def _from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The products summed in fp32 (of bf16-rounded weights for a bf16 model), rounded
        once to x's dtype at the end, as _prepacked_in_fp32 computes them."""
        assert self.quantized is not None and self._kernels is not None
        q = self.quantized
        bf16_x = q.bf16 and x.dtype == torch.bfloat16   # the kernel may multiply it as is
        y = self._kernels.quant_linear(x if bf16_x else x.float(), q.blocks, q.q4, q.bf16)
        if self._bias_fp32 is not None:
            y.add_(self._bias_fp32)
        return y.to(x.dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _transposed(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        assert self._kernels is not None
        return self._kernels.amx_linear(x, self.amx_packed, self.out_features, self._bias_fp32)

    def make_batch_invariant(self, rows: int) -> None:
        """--batch-invariant (runner/batch_invariance.py): each row's sums in one kernel and
        one order whatever the batch. fp32 GGUF blocks already are (one FMA chain per output,
        k in order, at any row count: quant_linear.cpp), so they serve every batch; else
        the dense kernel runs on tiles of exactly `rows` rows, the last one zero-padded."""
        self.fuses_silu_and_mul = False
        if self.quantized is not None and not self.quantized.bf16:
            self.max_block_rows = sys.maxsize
            return
        self.quantized, self.max_block_rows = None, 0   # bf16 blocks sum pairs up to 8 rows
        dense = self.forward

        def tiled(x: torch.Tensor) -> torch.Tensor:
            num_rows = x.shape[0]
            if num_rows == rows:
                return dense(x)
            padded = x.new_zeros(-(-num_rows // rows) * rows, x.shape[1])
            padded[:num_rows] = x
            return torch.cat([dense(tile) for tile in padded.split(rows)])[:num_rows]

        self.forward = tiled

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(y[:, :N/2]) * y[:, N/2:] for y = self(x), a gate_up projection, in one kernel
        (where fuses_silu_and_mul): the same bits as the two steps, without y.
        NOTE: SiLU-and-mul alone took 35 us a call inside a 32-row bf16 step against 20 on
        its own (y is split by columns over the cores, the SiLU by rows); fused, steps are
        ~1% faster (benchmarks.md 10k)."""
        assert self.fuses_silu_and_mul and self._kernels is not None
        return self._kernels.amx_linear_silu_mul(x, self.amx_packed, self.out_features)

    def _prepacked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def _prepacked_in_fp32(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.float(), self._packed, self._bias_fp32,
                                                  "none", [], "").to(x.dtype)


def _same_values(quantized: QuantizedMatrix | None, weight: torch.Tensor,
                 kernels: ModuleType | None) -> bool:
    """Whether the blocks expand to `weight` bit for bit, rounded to its dtype (fp32 or
    bf16), and a kernel can read them; checked on a strided sample of rows.
    NOTE: a sample, not every row: both come from one GGUF through two dequantizers, so a
    difference would be systematic (a format read another way), and expanding every row of
    every matrix took 2.7 s of a 6 s model load, at every worker (re)start."""
    if (quantized is None or kernels is None
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or weight.device.type != "cpu" or quantized.shape != tuple(weight.shape)
            or not kernels.quant_linear_supported()
            or not PackedBlocks.fits(quantized, kernels.vec_size)):
        return False
    num_rows = weight.shape[0]
    sample = torch.unique(torch.cat([torch.arange(0, num_rows, max(1, num_rows // _SAMPLE_ROWS)),
                                     torch.tensor([num_rows - 1])]))
    expanded = quantized.rows(sample).dequantize().to(weight.dtype)
    bits = torch.int32 if weight.dtype == torch.float32 else torch.int16
    if torch.equal(expanded.view(bits), weight[sample].view(bits)):
        return True
    log.warning("GGUF blocks differ from the loaded weight; that linear stays dense",
                shape=list(weight.shape))
    return False


def _try_prepack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN-prepacked weight, or None where this torch build cannot."""
    try:
        # NOTE: the batch-size hint only tunes the packing; any batch size works with it.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        _check_prepacked(tuple(weight.shape), weight.dtype, bias is not None)
        return packed
    except (RuntimeError, AttributeError) as e:
        _log_once(f"oneDNN cannot pack {weight.dtype} weights here ({e})")
        return None


@functools.cache
def _check_prepacked(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool) -> None:
    """Raises unless a prepacked linear of this shape and dtype computes what F.linear does.
    NOTE: once per shape, on random values: a model has a handful of shapes but ~200
    linears, and probing each took ~1 s of every worker start."""
    weight = torch.randn(shape, dtype=dtype)
    bias = torch.randn(shape[0], dtype=dtype) if has_bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    probe = torch.randn(2, shape[1], dtype=dtype)
    got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    want = F.linear(probe, weight, bias)
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        raise RuntimeError("prepacked linear disagrees with F.linear")


@functools.cache
def _log_once(message: str) -> None:
    """Said once per process, not once per linear layer."""
    log.warning(message)

