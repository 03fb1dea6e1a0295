"""Kernel-vs-reference checks, runnable in-process (CUDA) or as a subprocess (interpreter).

Each case is a function of the device that raises AssertionError on a mismatch. On CPU the
test modules run them through `python -m tests.kernels.kernel_cases NAME...` with
TRITON_INTERPRET=1 (see harness.py); this module must therefore import no kernel module at
import time: kernels are imported inside the cases, after the environment is set.
"""

import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from kernels.reference import (
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    ref_reshape_and_cache,
)
from tests.kernels.layer_ops_cases import LAYER_OPS_CHECKS
from tests.kernels.paged_batch import DTYPES, assert_close, make_paged_batch

RESULT_MARK = "@@kernel-case "


@dataclass(frozen=True)
class Case:
    run: Callable[[str], None]
    cuda_only: bool = False  # shapes too big for the interpreter's budget


# ---------------------------------------------------------------- reshape_and_cache


def check_cache(
    device: str, dtype: str, num_kv_heads: int, head_dim: int, slots: list[int],
    block_size: int = 16, num_blocks: int = 6, fp8: bool = False,
    scales: tuple[float, float] = (0.02, 0.05),
) -> None:
    from kernels import reshape_and_cache

    gen = torch.Generator().manual_seed(1)
    num_tokens = len(slots)
    # key/value as strided views of a fused kv tensor, the way a model produces them.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen) * 4
    if fp8:
        # Rounding traps (x / scale): ties to even, a carry into the exponent, saturation,
        # e4m3 subnormals; exact when the scales are powers of two.
        traps = torch.tensor([50.0, -400.0, 124.21875, 127.34375, 1000.0, -1e4, 0.0107421875])
        kv[0, :, 0, : len(traps)] = traps[None] * torch.tensor(scales)[:, None]
    kv = kv.to(DTYPES[dtype]).to(device)
    key, value = kv[:, 0], kv[:, 1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype = torch.float8_e4m3fn if fp8 else DTYPES[dtype]
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    # A tensor scale for k and a float for v: both forms are accepted.
    k_scale = torch.tensor(scales[0], device=device) if fp8 else None
    v_scale = scales[1] if fp8 else None
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    ref_reshape_and_cache(key, value, expected_k, expected_v, slot_mapping, k_scale, v_scale)
    if fp8:
        # The same e4m3 values as torch; compared as floats because +0 and -0 are equal.
        assert torch.equal(key_cache.float(), expected_k.float())
        assert torch.equal(value_cache.float(), expected_v.float())
        assert key_cache.float().abs().max() <= 448.0  # saturated, not inf / NaN
    else:
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


CACHE_CASES = {
    "cache_fp32_skipped_slots": Case(partial(
        check_cache, dtype="float32", num_kv_heads=2, head_dim=64,
        slots=[17, -1, 3, 95, -1, 40, 16])),
    "cache_bf16_three_kv_heads": Case(partial(
        check_cache, dtype="bfloat16", num_kv_heads=3, head_dim=64, slots=[5, 6, 7, 80, -1])),
    "cache_fp16_block8_head80": Case(partial(
        check_cache, dtype="float16", num_kv_heads=1, head_dim=80, block_size=8,
        slots=[-1, 0, 47, 9])),
    "cache_fp8_scaled_saturating": Case(partial(
        check_cache, dtype="bfloat16", num_kv_heads=2, head_dim=64, slots=[1, 33, -1, 70],
        fp8=True)),
    "cache_fp8_fp32_power_of_two_scales": Case(partial(
        check_cache, dtype="float32", num_kv_heads=1, head_dim=16, slots=[2, -1, 9],
        fp8=True, scales=(0.5, 0.25))),
}


# ---------------------------------------------------------------- decode


def check_decode(
    device: str, seq_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
    dtype: str, num_kv_splits: int | None, block_size: int = 16, fp8: bool = False,
    sliding_window: int | None = None, logits_soft_cap: float | None = None,
) -> None:
    from kernels import paged_decode_attention

    batch = make_paged_batch(
        seq_lens, [1] * len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype, device,
        block_size=block_size, fp8_cache=fp8,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.scale)
    scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale, sliding_window=sliding_window,
                  logits_soft_cap=logits_soft_cap)
    # A NaN-filled out buffer: any row the kernel fails to write fails the comparison.
    out = paged_decode_attention(
        *args, num_kv_splits=num_kv_splits, out=torch.full_like(batch.query, float("nan")),
        **scales,
    )
    assert_close(out, ref_paged_decode_attention(*args, **scales), device)


def check_choose_num_kv_splits(device: str) -> None:
    from kernels import choose_num_kv_splits

    del device
    assert choose_num_kv_splits(1, 8, 4096, num_sms=132) == 16  # tiny batch, long context
    assert choose_num_kv_splits(4, 8, 1024, num_sms=132) == 4  # capped by the context
    assert choose_num_kv_splits(64, 8, 8192, num_sms=132) == 1  # batch fills the GPU
    assert choose_num_kv_splits(1, 8, 200, num_sms=132) == 1  # short context
    assert choose_num_kv_splits(2, 3, 8192, num_sms=1) == 1  # interpreter


def _decode(**spec) -> Case:
    cuda_only = spec.pop("cuda_only", False)
    return Case(partial(check_decode, **spec), cuda_only)


DECODE_CASES = {
    "decode_choose_num_kv_splits": Case(check_choose_num_kv_splits),
    "decode_mha_fp32": _decode(
        seq_lens=[1, 17, 40, 33], num_q_heads=2, num_kv_heads=2, head_dim=64,
        dtype="float32", num_kv_splits=1),
    "decode_gqa3_fp16_smollm2_heads": _decode(
        seq_lens=[5, 16, 49], num_q_heads=9, num_kv_heads=3, head_dim=64,
        dtype="float16", num_kv_splits=1),
    "decode_gqa4_bf16_split4": _decode(
        seq_lens=[3, 70, 129], num_q_heads=8, num_kv_heads=2, head_dim=64,
        dtype="bfloat16", num_kv_splits=4),
    "decode_gqa8_fp32_split3_empty_splits_block8_head80": _decode(
        seq_lens=[1, 2, 100], num_q_heads=8, num_kv_heads=1, head_dim=80,
        dtype="float32", num_kv_splits=3, block_size=8),
    "decode_auto_splits_bf16": _decode(
        seq_lens=[33, 7], num_q_heads=4, num_kv_heads=4, head_dim=64,
        dtype="bfloat16", num_kv_splits=None),
    "decode_fp8_cache_split2": _decode(
        seq_lens=[20, 65], num_q_heads=6, num_kv_heads=2, head_dim=64,
        dtype="float16", num_kv_splits=2, fp8=True),
    # Windows shorter than most contexts; splits of the window only, some keys of the last
    # block outside it; a soft-cap small enough to bend random scores.
    "decode_window_fp32_split3_softcap": _decode(
        seq_lens=[1, 9, 40, 100], num_q_heads=4, num_kv_heads=2, head_dim=64,
        dtype="float32", num_kv_splits=3, sliding_window=12, logits_soft_cap=2.0),
    "decode_window_bf16_block8": _decode(
        seq_lens=[5, 33, 70], num_q_heads=8, num_kv_heads=2, head_dim=64,
        dtype="bfloat16", num_kv_splits=1, block_size=8, sliding_window=16),
    "decode_cuda_long_context_auto_splits": _decode(
        seq_lens=[4097, 1000, 1, 2500], num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype="bfloat16", num_kv_splits=None, cuda_only=True),
    "decode_cuda_big_batch_fp8": _decode(
        seq_lens=[(37 * i) % 700 + 1 for i in range(96)], num_q_heads=9, num_kv_heads=3,
        head_dim=64, dtype="bfloat16", num_kv_splits=None, fp8=True, cuda_only=True),
}


# ---------------------------------------------------------------- prefill


def check_prefill(
    device: str, seq_lens: list[int], q_lens: list[int], num_q_heads: int, num_kv_heads: int,
    head_dim: int, dtype: str, block_size: int = 16, fp8: bool = False,
    query_from_qkv: bool = False, sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    from kernels import paged_prefill_attention

    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, dtype, device,
        block_size=block_size, fp8_cache=fp8, query_from_qkv=query_from_qkv,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale, batch.max_query_len)
    scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale, sliding_window=sliding_window,
                  logits_soft_cap=logits_soft_cap)
    out = paged_prefill_attention(
        *args, out=torch.full_like(batch.query, float("nan")), **scales
    )
    assert_close(out, ref_paged_prefill_attention(*args, **scales), device)


def check_write_then_prefill(device: str) -> None:
    """The worker's order: write this step's K/V with reshape_and_cache, then attend."""
    from kernels import paged_prefill_attention, reshape_and_cache

    seq_lens, q_lens = [21, 9], [6, 9]
    batch = make_paged_batch(seq_lens, q_lens, 4, 2, 64, "float16", device)
    slot_mapping = torch.cat([
        batch.slots(seq, range(seq_len - q_len, seq_len))
        for seq, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens))
    ])
    new_kv = torch.randn(2, sum(q_lens), 2, 64, dtype=torch.float16, device=device)
    reshape_and_cache(new_kv[0], new_kv[1], batch.key_cache, batch.value_cache, slot_mapping)
    expected_k = batch.key_cache.view(-1, 2, 64)[slot_mapping]
    assert torch.equal(expected_k, new_kv[0])
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.scale, batch.max_query_len)
    assert_close(paged_prefill_attention(*args), ref_paged_prefill_attention(*args), device)


def _prefill(**spec) -> Case:
    cuda_only = spec.pop("cuda_only", False)
    return Case(partial(check_prefill, **spec), cuda_only)


PREFILL_CASES = {
    "prefill_mha_fp32_fresh_prompts": _prefill(
        seq_lens=[5, 23, 1], q_lens=[5, 23, 1], num_q_heads=2, num_kv_heads=2, head_dim=64,
        dtype="float32"),
    "prefill_gqa3_fp16_cached_prefix_qkv_view": _prefill(
        seq_lens=[40, 19, 33], q_lens=[8, 19, 1], num_q_heads=9, num_kv_heads=3, head_dim=64,
        dtype="float16", query_from_qkv=True),
    "prefill_gqa4_bf16_chunked_with_decode_rows": _prefill(
        seq_lens=[25, 50, 3, 47], q_lens=[1, 12, 1, 30], num_q_heads=8, num_kv_heads=2,
        head_dim=64, dtype="bfloat16"),
    "prefill_gqa8_fp32_many_q_blocks_block8_head80": _prefill(
        seq_lens=[90, 4], q_lens=[70, 2], num_q_heads=8, num_kv_heads=1, head_dim=80,
        dtype="float32", block_size=8),
    "prefill_empty_query_row_fp32": _prefill(
        seq_lens=[3, 10, 5], q_lens=[3, 0, 5], num_q_heads=2, num_kv_heads=1, head_dim=64,
        dtype="float32"),
    "prefill_fp8_cache_bf16": _prefill(
        seq_lens=[30, 18], q_lens=[14, 18], num_q_heads=4, num_kv_heads=2, head_dim=64,
        dtype="bfloat16", fp8=True),
    "prefill_write_then_attend_fp16": Case(check_write_then_prefill),
    # Fresh prompts and chunks after a context longer than the window, windows shorter and
    # longer than the kernel's key tile, a soft-capped case.
    "prefill_window8_fp32_chunks_softcap": _prefill(
        seq_lens=[30, 90, 7], q_lens=[30, 20, 7], num_q_heads=4, num_kv_heads=2, head_dim=64,
        dtype="float32", sliding_window=8, logits_soft_cap=3.0),
    "prefill_window80_fp16_gqa4_block8": _prefill(
        seq_lens=[150, 40, 1], q_lens=[100, 1, 1], num_q_heads=8, num_kv_heads=2,
        head_dim=64, dtype="float16", block_size=8, sliding_window=80),
    "prefill_cuda_long_prompts_mixed": _prefill(
        seq_lens=[1500, 2048, 700, 64, 3000], q_lens=[1500, 512, 1, 64, 1],
        num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", cuda_only=True),
    "prefill_cuda_smollm2_fp8": _prefill(
        seq_lens=[900, 300, 17], q_lens=[400, 300, 1], num_q_heads=9, num_kv_heads=3,
        head_dim=64, dtype="float16", fp8=True, cuda_only=True),
}

LAYER_OPS_CASES = {name: Case(check) for name, check in LAYER_OPS_CHECKS.items()}

CASES: dict[str, Case] = {**CACHE_CASES, **DECODE_CASES, **PREFILL_CASES, **LAYER_OPS_CASES}


def main(names: list[str]) -> None:
    """Runs the named cases on CPU, one JSON line per event on stdout, so the parent can tell
    which case was running if the interpreter kills the process."""
    for name in names:
        print(RESULT_MARK + json.dumps({"case": name, "event": "start"}), flush=True)
        try:
            CASES[name].run("cpu")
            error = None
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            error = traceback.format_exc()
        print(RESULT_MARK + json.dumps({"case": name, "event": "done", "error": error}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
