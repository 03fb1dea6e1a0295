"""The `triton` attention backend: an adapter over the paged-KV kernels in kernels/ (GPU path).

Per layer: reshape_and_cache writes the step's keys/values, then paged_decode_attention runs
the decode rows (one query token each, all heads of a KV head in one program) and
paged_prefill_attention the prefill chunks, both reading the paged cache in place.
Nothing here reads device values back to the host, so a decode-only step can be captured in a
CUDA graph (services/worker/runner/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    CommonAttentionMetadata,
    KVCache,
)


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor              # int64 [num_tokens], -1 = skip
    num_decodes: int
    num_prefills: int
    decode_block_table: torch.Tensor        # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor           # int32 [num_decodes]
    prefill_block_table: torch.Tensor       # int32 [num_prefills, max_blocks]
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor   # int32 [num_prefills + 1], from 0
    max_query_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        # NOTE: imported here, not at module level: only a triton-backed worker pays for
        # importing triton, and the CPU path never needs kernels/ at all.
        import kernels

        self._reshape_and_cache = kernels.reshape_and_cache
        self._decode_attention = kernels.paged_decode_attention
        self._prefill_attention = kernels.paged_prefill_attention

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        num_decodes, num_prefills = common.num_decodes, common.num_prefills
        query_start_loc = common.query_start_loc[num_decodes:]
        if num_prefills and num_decodes:
            query_start_loc = query_start_loc - num_decodes  # decode rows come first, one each
        return TritonAttentionMetadata(
            slot_mapping=common.slot_mapping,
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            decode_block_table=common.block_table[:num_decodes],
            decode_seq_lens=common.seq_lens[:num_decodes],
            prefill_block_table=common.block_table[num_decodes:],
            prefill_seq_lens=common.seq_lens[num_decodes:],
            prefill_query_start_loc=query_start_loc,
            max_query_len=common.max_query_len,
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: TritonAttentionMetadata,
                layer: AttentionLayer | None = None) -> torch.Tensor:
        layer = layer or self.default_layer
        scales = dict(k_scale=kv_cache.k_scale_tensor, v_scale=kv_cache.v_scale_tensor)
        self._reshape_and_cache(key, value, kv_cache.key, kv_cache.value, metadata.slot_mapping,
                                **scales)
        per_layer = dict(sliding_window=layer.sliding_window,
                         logits_soft_cap=layer.logits_soft_cap, **scales)
        num_tokens, num_decodes = query.shape[0], metadata.num_decodes
        out = query.new_empty(num_tokens, self.num_heads, self.head_dim)
        if num_decodes:
            self._decode_attention(
                query[:num_decodes], kv_cache.key, kv_cache.value, metadata.decode_block_table,
                metadata.decode_seq_lens, layer.scale, out=out[:num_decodes], **per_layer)
        if metadata.num_prefills:
            self._prefill_attention(
                query[num_decodes:], kv_cache.key, kv_cache.value, metadata.prefill_block_table,
                metadata.prefill_query_start_loc, metadata.prefill_seq_lens, layer.scale,
                metadata.max_query_len, out=out[num_decodes:], **per_layer)
        return out.view(num_tokens, -1)
