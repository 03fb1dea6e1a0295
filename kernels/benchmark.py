"""Kernel timings on a GPU: `python -m kernels.benchmark` (one line per shape).

Decode and the cache write are bandwidth-bound, so they report GB/s of KV (and K/V input)
bytes moved; prefill reports causal-attention TFLOP/s. `--device cpu` runs tiny shapes once
in the interpreter (set TRITON_INTERPRET=1) to check the script itself, not to measure.
"""

import argparse
import os
import time
from collections.abc import Callable

import torch

# (name, num_q_heads, num_kv_heads, head_dim): SmolLM2-135M and a Llama-3-8B-shaped layer.
MODELS = [("smollm2", 9, 3, 64), ("llama8b", 32, 8, 128)]
BLOCK_SIZE = 16


def _time_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _paged_cache(num_seqs: int, context: int, num_kv_heads: int, head_dim: int, dtype,
                 device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = 1 + num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device).to(dtype)
    value_cache = torch.randn(shape, device=device).to(dtype)
    block_tables = (1 + torch.randperm(num_blocks - 1, device=device)).view(num_seqs, -1)
    return key_cache, value_cache, block_tables.to(torch.int32)


def bench_decode(device: str, batches: list[int], contexts: list[int], fp8: bool) -> None:
    from kernels import paged_decode_attention

    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    for name, hq, hkv, d in MODELS:
        for num_seqs in batches:
            for context in contexts:
                kc, vc, bt = _paged_cache(num_seqs, context, hkv, d, cache_dtype, device)
                q = torch.randn(num_seqs, hq, d, device=device, dtype=torch.bfloat16)
                seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
                ms = _time_ms(lambda: paged_decode_attention(q, kc, vc, bt, seq_lens, d**-0.5,
                                                             k_scale=0.05, v_scale=0.05), device)
                kv_bytes = 2 * num_seqs * context * hkv * d * kc.element_size()
                print(f"decode  {name:8} kv={str(cache_dtype)[6:]:13} B={num_seqs:<4} "
                      f"ctx={context:<5} {ms * 1e3:9.1f} us {kv_bytes / ms / 1e6:8.1f} GB/s")


def bench_prefill(device: str, num_seqs: int, prompt_len: int) -> None:
    from kernels import paged_prefill_attention

    for name, hq, hkv, d in MODELS:
        kc, vc, bt = _paged_cache(num_seqs, prompt_len, hkv, d, torch.bfloat16, device)
        q = torch.randn(num_seqs * prompt_len, hq, d, device=device, dtype=torch.bfloat16)
        seq_lens = torch.full((num_seqs,), prompt_len, dtype=torch.int32, device=device)
        starts = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * prompt_len
        ms = _time_ms(lambda: paged_prefill_attention(q, kc, vc, bt, starts, seq_lens, d**-0.5,
                                                      prompt_len), device)
        flops = 4 * num_seqs * prompt_len * prompt_len / 2 * hq * d  # QK^T and PV, causal half
        print(f"prefill {name:8} {num_seqs}x{prompt_len:<5} {ms * 1e3:9.1f} us "
              f"{flops / ms / 1e9:8.1f} TFLOP/s")


def bench_cache_write(device: str, num_tokens: int) -> None:
    from kernels import reshape_and_cache

    for name, _, hkv, d in MODELS:
        kc, vc, _ = _paged_cache(1, num_tokens, hkv, d, torch.bfloat16, device)
        key = torch.randn(num_tokens, hkv, d, device=device, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        slots = torch.randperm(num_tokens, device=device) + BLOCK_SIZE  # skip the null block
        ms = _time_ms(lambda: reshape_and_cache(key, value, kc, vc, slots), device)
        moved = 4 * key.numel() * key.element_size()  # read K, V and write them
        print(f"cache   {name:8} T={num_tokens:<6} {ms * 1e3:9.1f} us "
              f"{moved / ms / 1e6:8.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = parser.parse_args().device
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 in the environment")
    tiny = device == "cpu"
    for fp8 in (False, True):
        bench_decode(device, [2] if tiny else [1, 32, 128], [40] if tiny else [1024, 4096], fp8)
    bench_prefill(device, 1 if tiny else 4, 40 if tiny else 2048)
    bench_cache_write(device, 20 if tiny else 8192)


if __name__ == "__main__":
    main()
