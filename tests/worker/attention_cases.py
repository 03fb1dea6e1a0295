"""Mixed paged-attention steps for backend tests: decodes, fresh prefills, chunks after a prefix.

Also runnable as `python -m tests.worker.attention_cases` (see tests/kernels/harness.py
json_cases): runs the triton backend on KERNEL_TEST_DEVICE (compiled on CUDA, the interpreter
on CPU) against the torch backend on CPU and prints one JSON line of max errors per case.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from kernels.reference import ref_paged_prefill_attention, ref_reshape_and_cache
from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata, KVCache
from tests.kernels.harness import DEVICE

BLOCK_SIZE = 16


@dataclass
class AttentionCase:
    name: str
    num_heads: int
    num_kv_heads: int
    context_lens: list[int]    # tokens already in the cache, per request
    query_lens: list[int]      # this step's tokens, per request (decodes first)
    dtype: torch.dtype = torch.float32
    fp8: bool = False
    head_dim: int = 32


CASES = [
    AttentionCase("mha_mixed", 4, 4, [17, 40, 0, 33], [1, 1, 23, 9]),
    AttentionCase("gqa3_decode_only", 9, 3, [5, 15, 16, 100], [1, 1, 1, 1]),
    AttentionCase("gqa4_prefill_only", 8, 2, [0, 31, 48], [70, 16, 3]),
    AttentionCase("gqa2_bf16", 4, 2, [20, 0, 7], [1, 30, 12], dtype=torch.bfloat16),
    AttentionCase("gqa3_fp8", 6, 2, [29, 64, 0], [1, 5, 19], fp8=True),
    AttentionCase("gqa3_fp8_bf16", 6, 2, [40, 3, 0], [1, 1, 21], dtype=torch.bfloat16,
                  fp8=True),
]


@dataclass
class Step:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    common: CommonAttentionMetadata


def make_step(case: AttentionCase, seed: int = 0) -> Step:
    """Shuffled blocks (never block 0), random cached context, zeros in every unused slot."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = np.array(case.context_lens) + np.array(case.query_lens)
    blocks_per_req = -(-seq_lens // BLOCK_SIZE)
    num_blocks = 1 + int(blocks_per_req.sum()) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = np.zeros((len(seq_lens), int(blocks_per_req.max()) + 1), dtype=np.int32)
    for i, n in enumerate(blocks_per_req.tolist()):
        block_table[i, :n], order = order[:n], order[n:]
    cache_dtype = torch.float8_e4m3fn if case.fp8 else case.dtype
    shape = (num_blocks, BLOCK_SIZE, case.num_kv_heads, case.head_dim)
    key_cache = torch.zeros(shape, dtype=cache_dtype)
    value_cache = torch.zeros(shape, dtype=cache_dtype)
    for i, context in enumerate(case.context_lens):
        positions = np.arange(context)
        slots = block_table[i, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        for cache in (key_cache, value_cache):
            values = torch.randn(context, case.num_kv_heads, case.head_dim, generator=gen)
            cache.view(-1, case.num_kv_heads, case.head_dim)[torch.from_numpy(slots).long()] = (
                values.to(cache_dtype))
    query_lens = np.array(case.query_lens)
    num_tokens = int(query_lens.sum())
    query_start_loc = np.concatenate(([0], np.cumsum(query_lens)))
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(case.context_lens,
                                                                       case.query_lens)])
    token_req = np.repeat(np.arange(len(query_lens)), query_lens)
    slot_mapping = (block_table[token_req, positions // BLOCK_SIZE] * BLOCK_SIZE
                    + positions % BLOCK_SIZE)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, case.head_dim, generator=gen).to(case.dtype)

    common = CommonAttentionMetadata(
        num_reqs=len(query_lens), num_actual_tokens=num_tokens,
        num_decodes=int((query_lens == 1).sum()), max_query_len=int(query_lens.max()),
        query_start_loc=torch.from_numpy(query_start_loc).int(),
        query_start_loc_cpu=query_start_loc, seq_lens=torch.from_numpy(seq_lens).int(),
        seq_lens_cpu=seq_lens, block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping).long())
    return Step(rand(case.num_heads), rand(case.num_kv_heads), rand(case.num_kv_heads),
                key_cache, value_cache, common)


def step_on(step: Step, device: str) -> Step:
    """The step with its tensors on `device` (host arrays stay)."""
    def moved(obj: Step | CommonAttentionMetadata) -> dict[str, torch.Tensor]:
        return {f.name: getattr(obj, f.name).to(device) for f in fields(obj)
                if isinstance(getattr(obj, f.name), torch.Tensor)}

    return replace(step, common=replace(step.common, **moved(step.common)), **moved(step))


def unit_kv_cache(step: Step) -> KVCache:
    """Copies of the step's caches, fp8 scales 1, on the step's device."""
    one = torch.ones(1, device=step.key_cache.device)
    return KVCache(step.key_cache.clone(), step.value_cache.clone(), k_scale_tensor=one,
                   v_scale_tensor=one.clone())


def run_backend(backend_cls: type[AttentionBackend], case: AttentionCase,
                step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [T, Hq * D], key cache, value cache after the write) on copies of the caches."""
    backend = backend_cls(case.num_heads, case.num_kv_heads, case.head_dim,
                          case.head_dim ** -0.5, BLOCK_SIZE)
    kv_cache = unit_kv_cache(step)
    out = backend.forward(step.query, step.key, step.value, kv_cache,
                          backend.build_metadata(step.common))
    return out, kv_cache.key, kv_cache.value


def run_reference(case: AttentionCase, step: Step) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """kernels.reference on the step: (output [T, Hq, D], key cache, value cache)."""
    key_cache, value_cache = step.key_cache.clone(), step.value_cache.clone()
    ref_reshape_and_cache(step.key, step.value, key_cache, value_cache,
                          step.common.slot_mapping)
    out = ref_paged_prefill_attention(
        step.query, key_cache, value_cache, step.common.block_table,
        step.common.query_start_loc, step.common.seq_lens, case.head_dim ** -0.5)
    return out, key_cache, value_cache


def _compare_triton_with_torch() -> None:
    from services.worker.attention.torch_attn import TorchAttentionBackend
    from services.worker.attention.triton_attn import TritonAttentionBackend

    for case in CASES:
        step = make_step(case)
        want, want_k, want_v = run_backend(TorchAttentionBackend, case, step)
        got, got_k, got_v = (t.cpu() for t in run_backend(TritonAttentionBackend, case,
                                                           step_on(step, DEVICE)))
        print(json.dumps({
            "case": case.name,
            "out": float((got.float() - want.float()).abs().max()),
            "cache": max(float((a.float() - b.float()).abs().max())
                         for a, b in ((got_k, want_k), (got_v, want_v)))}), flush=True)


if __name__ == "__main__":
    _compare_triton_with_torch()
    sys.exit(0)
