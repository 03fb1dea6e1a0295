"""Attention backends behind one interface (backend.py), chosen once at start-up."""

from __future__ import annotations

import os

import torch

from services.worker.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    KVCache,
)

ATTENTION_BACKENDS = ("torch", "triton")

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "CommonAttentionMetadata", "KVCache",
           "get_attention_backend_cls"]


def get_attention_backend_cls(name: str, device: torch.device,
                              kv_cache_dtype: str = "auto") -> type[AttentionBackend]:
    """`auto` picks triton on CUDA and torch elsewhere; triton is imported only when chosen.

    On CPU, `torch` runs its KV write and attention in the C++ kernels (kernels/cpu_ops.py)
    when they could be built, and in torch ops otherwise. An fp8 KV cache stays on the torch
    ops: they attend a prompt to its own unquantized K/V (the kernels read every key from
    the quantized cache, which flipped the first token of 1 prompt in 12 against fp32).
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from services.worker.runner.cpu_runtime import load_cpu_kernels

        if device.type == "cpu" and kv_cache_dtype != "fp8" and load_cpu_kernels() is not None:
            from services.worker.attention.cpu_attn import CpuAttentionBackend

            return CpuAttentionBackend
        from services.worker.attention.torch_attn import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        # NOTE: on CPU only under the Triton interpreter (TRITON_INTERPRET=1), which the tests
        # use to check this adapter against the torch backend.
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs a CUDA device; "
                             "use --attention-backend torch on CPU")
        from services.worker.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(f"unknown attention backend {name!r} (choose from auto, "
                     f"{', '.join(ATTENTION_BACKENDS)})")
