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


def get_attention_backend_cls(name: str, device: torch.device) -> type[AttentionBackend]:
    """`auto` picks triton on CUDA and torch elsewhere; triton is imported only when chosen."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
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
