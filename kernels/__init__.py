"""Paged-KV kernels: Triton versions for GPUs and torch references they are tested against.

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None)
    paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                           num_kv_splits=None, k_scale=None, v_scale=None, out=None)
    paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                            seq_lens, scale, max_query_len, k_scale=None, v_scale=None, out=None)
    ref_reshape_and_cache / ref_paged_decode_attention / ref_paged_prefill_attention: the same
    in plain torch (fp32 math), for the CPU backend and the tests.
    Both attentions also take sliding_window=None (query at p sees keys p - window < j <= p)
    and logits_soft_cap=None (scores -> cap * tanh(scores / cap)), per layer.
    fused_moe(hidden, w13, w2, topk_weights, topk_ids) / ref_fused_moe: mixture-of-experts
    (Triton grouped GEMMs / the torch reference grouped by expert, also the CPU path).

Conventions: caches are [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's flash layout),
slot = block_id * block_size + offset, block 0 is the null block; block_tables int32
[num_seqs, max_blocks] padded with 0; seq_lens int32 count this step's query tokens;
query_start_loc int32 [num_seqs + 1]. A float8_e4m3fn cache holds x / scale (per tensor).

NOTE: names resolve lazily (PEP 562). Importing the references must not import triton: it
costs a second on the CPU path, and triton decides at decoration time whether a kernel runs in
the interpreter, so kernels must be decorated only after TRITON_INTERPRET has been set.
"""

import importlib
from typing import Any

_NAME_TO_MODULE = {
    "reshape_and_cache": "kernels.triton_cache",
    "paged_decode_attention": "kernels.triton_decode_attention",
    "paged_prefill_attention": "kernels.triton_prefill_attention",
    "choose_num_kv_splits": "kernels.triton_decode_attention",
    "ref_reshape_and_cache": "kernels.reference",
    "ref_paged_decode_attention": "kernels.reference",
    "ref_paged_prefill_attention": "kernels.reference",
    "fused_moe": "kernels.triton_fused_moe",
    "ref_fused_moe": "kernels.moe_reference",
}

__all__ = sorted(_NAME_TO_MODULE)


def __getattr__(name: str) -> Any:
    module = _NAME_TO_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
