"""The worker's start line names the attention that runs: `cpu` where the C++ kernels take
the head size, `torch` where they do not."""

from __future__ import annotations

import torch

from services.worker.attention import get_attention_backend_cls
from services.worker.attention.torch_attn import TorchAttentionBackend
from tests.worker.cpu_kernels import require_cpu_ops


def test_the_cpu_backend_names_the_kernels_or_the_torch_fallback() -> None:
    ops = require_cpu_ops()
    backend = get_attention_backend_cls("auto", torch.device("cpu"))
    assert backend(9, 3, 64, 0.125, 16).name == "cpu"
    assert not ops.supports_head_dim(12)
    assert backend(9, 3, 12, 0.3, 16).name == "torch"   # no kernel for this head size
    assert get_attention_backend_cls("torch", torch.device("cpu"), "fp8") is TorchAttentionBackend
    assert TorchAttentionBackend(9, 3, 64, 0.125, 16).name == "torch"
