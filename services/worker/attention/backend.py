"""The attention backend interface: metadata built once per step, then one call per layer.

Every backend reads the same paged KV layout (vLLM's flash layout, shared with kernels/):
key / value caches are [num_blocks, block_size, num_kv_heads, head_dim] per layer, token slot =
block_id * block_size + offset, block 0 is the null block padding entries point at. In each
layer the step's new keys / values are written to their slots before attention reads them.
What differs between a model's layers (scale, sliding window, soft-cap) travels with each call
as an AttentionLayer, so one backend and one metadata per step serve every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class KVCache:
    """One layer's paged cache. A float8_e4m3fn cache stores x / scale (saturated at +-448)."""

    key: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    # NOTE: the same scales as 1-element device tensors: kernels read them through a pointer,
    # which costs no host copy per call and stays valid inside a CUDA graph.
    k_scale_tensor: torch.Tensor | None = None
    v_scale_tensor: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype == torch.float8_e4m3fn


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention parameters (vLLM's per-layer Attention impl arguments)."""

    scale: float
    # NOTE: HF's convention: query at position p sees keys (p - sliding_window, p], itself and
    # the sliding_window - 1 before it. None: every earlier key.
    sliding_window: int | None = None
    # Gemma 2: scores become cap * tanh(scores / cap) before the softmax. None: no capping.
    logits_soft_cap: float | None = None


@dataclass
class CommonAttentionMetadata:
    """A step's flattened varlen batch as every backend sees it (vLLM's name).

    Requests are ordered decodes first: requests [0, num_decodes) have exactly one query token
    (so query rows [0, num_decodes) are theirs), the rest are prefill chunks.
    """

    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    max_query_len: int
    query_start_loc: torch.Tensor      # int32 [num_reqs + 1], on the device
    query_start_loc_cpu: np.ndarray
    seq_lens: torch.Tensor             # int32 [num_reqs]: context length incl. this step's query
    seq_lens_cpu: np.ndarray
    block_table: torch.Tensor          # int32 [num_reqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor         # int64 [num_tokens]; -1 = don't write (padding)

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


class AttentionBackend(ABC):
    """One instance per model; `forward` is called by every layer with that layer's cache."""

    name: str
    """What the worker's start line calls the implementation that runs (`cpu`: the C++
    kernels; `torch`: torch ops; `triton`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.default_layer = AttentionLayer(scale)

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Backend-specific metadata (gather indices, masks...), shared by all layers."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: Any,
                layer: AttentionLayer | None = None) -> torch.Tensor:
        """Writes key/value [T, Hkv, D] to the cache, attends query [T, Hq, D]: [T, Hq * D].
        `layer` None: plain causal attention at the backend's scale."""
