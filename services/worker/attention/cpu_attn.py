"""The `torch` backend's CPU fast path: the KV write and attention in C++ (kernels/cpu).

Per step, the kernels make a work plan (kernels/cpu/attention_plan.cpp: query tiles for prefill
chunks, KV splits for long decodes, largest first, taken by whichever thread is free) that
every layer reuses; layers with a sliding window share one of their own, whose key ranges start
at the window (made by the first such layer of the step). Per layer, forward is two calls:
reshape_and_cache, then paged_attention, which reads K/V in place through the block table: no
gather copy, no padding to the longest context, all query heads of a KV head together (GQA), a
cached prefix read like any other context. The torch backend it extends stays the fallback (kernels not built, head
size without a kernel) and the reference the tests hold it to.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from services.worker.attention.backend import AttentionLayer, CommonAttentionMetadata, KVCache
from services.worker.attention.torch_attn import TorchAttentionBackend
from services.worker.runner.cpu_runtime import load_cpu_kernels


@dataclass
class CpuAttentionPlan:
    items: torch.Tensor          # int32 [num_items, 8]: the plan's work items, largest first
    merges: torch.Tensor         # int32 [num_merges, 4]: decodes cut into KV splits
    partials: torch.Tensor       # fp32 scratch for the splits' partial results


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor   # int64 [num_tokens]
    block_table: torch.Tensor    # int32 [num_reqs, max_blocks]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    plans: dict[int | None, CpuAttentionPlan]   # by sliding window (None: global layers)


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 block_size: int, ops: ModuleType | None = None):
        """ops: the loaded kernels (default: load_cpu_kernels())."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        ops = ops or load_cpu_kernels()
        self.ops = ops if ops is not None and ops.supports_head_dim(head_dim) else None
        # NOTE: the start line names what runs: the torch ops where no kernel fits the head size.
        self.name = "cpu" if self.ops is not None else "torch"
        # --batch-invariant (runner/batch_invariance.py): every query token in prefill tiles.
        self.batch_invariant = False

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        if self.ops is None:
            return super().build_metadata(common)
        return CpuAttentionMetadata(common.slot_mapping, common.block_table,
                                    common.query_start_loc, common.seq_lens, {})

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: KVCache, metadata: Any,
                layer: AttentionLayer | None = None) -> torch.Tensor:
        if self.ops is None:
            return super().forward(query, key, value, kv_cache, metadata, layer)
        layer = layer or self.default_layer
        plan = self._plan(metadata, layer.sliding_window)
        self.ops.reshape_and_cache(key, value, kv_cache.key, kv_cache.value,
                                   metadata.slot_mapping, kv_cache.k_scale, kv_cache.v_scale)
        out = query.new_empty(query.shape[0], self.num_heads * self.head_dim)
        # NOTE: the kernels read 0 as "no window" and "no cap".
        self.ops.paged_attention(out, query, kv_cache.key, kv_cache.value, metadata.block_table,
                                 plan.items, plan.merges, plan.partials,
                                 layer.scale, kv_cache.k_scale, kv_cache.v_scale,
                                 layer.sliding_window or 0, layer.logits_soft_cap or 0.0,
                                 self.batch_invariant)
        return out

    def _plan(self, metadata: CpuAttentionMetadata, window: int | None) -> CpuAttentionPlan:
        plan = metadata.plans.get(window)
        if plan is None:
            plan = metadata.plans[window] = CpuAttentionPlan(*self.ops.attention_plan(
                metadata.query_start_loc, metadata.seq_lens, self.num_kv_heads,
                self.num_heads // self.num_kv_heads, self.head_dim, window or 0,
                self.batch_invariant))
        return plan
