"""A decoder layer's small steps (RMSNorm with the residual add, SiLU-and-mul): torch, C++ or
Triton. GELU(tanh)-and-mul (Gemma) has no fused kernel: it runs in torch on every path.

TorchLayerOps is the reference. TritonLayerOps, the CUDA path, runs each step as one Triton
kernel (kernels/triton_layer_ops.py): bit-exact with torch on CUDA, but for RMSNorm, whose
sum of squares is reduced in another order (fp32: a few ulps; 16-bit: a rare near-tie rounds
the other way).
CpuLayerOps runs each step as one fused C++ kernel (kernels/cpu/layer_ops.cpp) that rounds
where the torch expressions round: they agree bit for bit, but for RMSNorm in fp32, whose sum
of squares is reduced in another order (the last bit may differ; greedy output still equals
HF's, tests/worker/test_runner_vs_hf.py). Measured at a batch-1 decode step of SmolLM2-135M
(2 cores): the torch versions cost ~60 small ops per step in dispatch and temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from services.worker.models.config import UnsupportedModelError


class TorchLayerOps:
    # The module whose rotary_embedding(x, cos, sin) rotates in place (rotary.py), if any.
    rotary_kernels: ModuleType | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim (x may be a strided [T, H, D] view): a new tensor."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        # NOTE: 16-bit inputs round as HF's LlamaRMSNorm does (normalize in fp32, cast, then
        # scale in the model dtype); F.rms_norm on them rounds once at the end and differs in
        # ~1/4 of elements.
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); the sum is made in x's storage.

        NOTE: x + residual is the same IEEE sum as HF's residual + x.
        """
        residual = x if residual is None else x.add_(residual)
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] ([T, 2I]): [T, I]."""
        size = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :size]).mul_(gate_up[:, size:])

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (HF's gelu_pytorch_tanh) for gate_up = [gate | up]: [T, I]."""
        size = gate_up.shape[1] // 2
        return F.gelu(gate_up[:, :size], approximate="tanh").mul_(gate_up[:, size:])

    def act_and_mul(self, hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gated MLP's activation-and-mul for an HF `hidden_act` name."""
        if hidden_act == "silu":
            return self.silu_and_mul
        if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
            return self.gelu_tanh_and_mul
        raise UnsupportedModelError(f"MLP activation {hidden_act!r} is not supported")


class CpuLayerOps(TorchLayerOps):
    def __init__(self, ops: ModuleType):
        self.ops = ops
        self.rotary_kernels = ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, weight, eps), x
        return self.ops.add_rms_norm(x, residual, weight, eps), x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)


class TritonLayerOps(TorchLayerOps):
    """One kernel per step on CUDA, where the torch versions launch ~22 small kernels per layer
    (measured: 717 per decode step of SmolLM2-135M's 30 layers on an H200)."""

    def __init__(self) -> None:
        # NOTE: imported here so that only models on a GPU import triton (a second at start-up).
        from kernels import triton_layer_ops

        self.ops = triton_layer_ops
        self.rotary_kernels = triton_layer_ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _is_dense_rows(x, weight):
            return super().rms_norm(x, weight, eps)
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        if x.dim() != 2 or not _is_dense_rows(x, weight) or residual.stride(-1) != 1:
            return super().add_rms_norm(x, residual, weight, eps)
        return self.ops.add_rms_norm(x, residual, weight, eps), x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.stride(-1) != 1:
            return super().silu_and_mul(gate_up)
        return self.ops.silu_and_mul(gate_up)


def layer_ops_for(device: torch.device, cpu_kernels: ModuleType | None) -> TorchLayerOps:
    """Triton on CUDA, the C++ kernels on CPU where they could be built, else torch."""
    if device.type == "cuda":
        return TritonLayerOps()
    return CpuLayerOps(cpu_kernels) if cpu_kernels is not None else TorchLayerOps()


def _is_dense_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take x: [T, D] or [T, H, D] rows with a dense last dim, and a
    weight of x's dtype (torch promotes a mixed pair; the kernels round to x's dtype)."""
    return x.dim() in (2, 3) and x.stride(-1) == 1 and weight.dtype == x.dtype
