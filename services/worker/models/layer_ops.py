"""A decoder layer's small steps (RMSNorm with the residual add, SiLU-and-mul): torch or C++.
GELU(tanh)-and-mul (Gemma) has no C++ kernel: it runs in torch on every path.

TorchLayerOps is the reference and the GPU path; CpuLayerOps runs each step as one fused C++
kernel (kernels/cpu/layer_ops.cpp) that rounds where the torch expressions round: they agree
bit for bit, but for RMSNorm in fp32, whose sum of squares is reduced in another order (the
last bit may differ; greedy output still equals HF's, tests/worker/test_runner_vs_hf.py). Measured at a batch-1 decode step of SmolLM2-135M (2 cores): the torch
versions cost ~60 small ops per step in dispatch and temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from services.worker.models.config import UnsupportedModelError


class TorchLayerOps:
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

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, weight, eps), x
        return self.ops.add_rms_norm(x, residual, weight, eps), x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)

