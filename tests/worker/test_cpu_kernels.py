"""The C++ CPU kernels (kernels/cpu) against their references: the attention backend on the
shared mixed-step cases and on long decodes cut into KV splits, the fp8 cache write, and the
fused layer ops against the torch expressions they replace (bit for bit, but for RMSNorm in
fp32: its sum of squares is reduced in another order, so it may differ in the last bit).
Skipped, with the reason, where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.cpu_attn import CpuAttentionBackend
from services.worker.models.layer_ops import CpuLayerOps, TorchLayerOps
from services.worker.models.rotary import RotaryEmbedding
from tests.worker.attention_cases import CASES, AttentionCase, make_step, run_backend, run_reference
from tests.worker.cpu_kernels import num_threads, require_cpu_ops

LONG_CASES = [
    # Decodes over long contexts: the plan splits them across threads and merges.
    AttentionCase("gqa3_long_decodes", 9, 3, [2100, 700, 15], [1, 1, 1], head_dim=64),
    AttentionCase("mha_long_prefill_tile", 4, 4, [300], [77], head_dim=64),
    AttentionCase("gqa4_bf16_long", 8, 2, [1500, 0], [1, 40], dtype=torch.bfloat16,
                  head_dim=64),
    # bf16 prompt chunks after long prefixes and from scratch (AMX tiles where the CPU has
    # them; head_dim 128 takes two passes of O tiles there).
    AttentionCase("gqa3_bf16_prefill_chunks", 9, 3, [300, 0, 17], [77, 128, 45],
                  dtype=torch.bfloat16, head_dim=64),
    AttentionCase("gqa3_bf16_prefill_d128", 6, 2, [0, 40], [100, 3], dtype=torch.bfloat16,
                  head_dim=128),
]


def _tolerance(case: AttentionCase) -> float:
    return 2e-2 if case.dtype == torch.bfloat16 else 2e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES + LONG_CASES, ids=[c.name for c in CASES + LONG_CASES])
def test_cpu_attention_matches_reference(case: AttentionCase, threads: int) -> None:
    require_cpu_ops()
    step = make_step(case)
    with num_threads(threads):
        out, key_cache, value_cache = run_backend(CpuAttentionBackend, case, step)
    want, ref_k, ref_v = run_reference(case, step)
    # The cache write is exact (fp8 included: the same rounding as torch's cast).
    assert torch.equal(key_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), ref_v.view(torch.uint8))
    err = (out.float() - want.reshape(out.shape).float()).abs().max().item()
    assert err <= _tolerance(case), err


def test_fp8_cache_write_saturates_and_skips_negative_slots() -> None:
    ops = require_cpu_ops()
    key = torch.tensor([[[1000.0, -1000.0, 0.3, 1.0] * 4]], dtype=torch.float32)
    key_cache = torch.zeros(2, 16, 1, 16, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros_like(key_cache)
    ops.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([17]), 1.0, 1.0)
    ops.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([-1]), 1.0, 1.0)
    row = key_cache.view(-1, 16)[17].float()
    assert row[:4].tolist() == [448.0, -448.0, float(torch.tensor(0.3).to(torch.float8_e4m3fn)),
                                1.0]
    assert int(key_cache.view(torch.uint8).count_nonzero()) == 16   # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_equal_the_torch_expressions(dtype: torch.dtype) -> None:
    ops = require_cpu_ops()
    gen = torch.Generator().manual_seed(0)
    fused, plain = CpuLayerOps(ops), TorchLayerOps()

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        if dtype == torch.float32:
            return torch.allclose(got, want, rtol=1e-6, atol=1e-6)   # a few ulp
        return torch.equal(got, want)

    x = torch.randn(7, 576, generator=gen).to(dtype)
    residual = torch.randn(7, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    assert same(fused.rms_norm(x, weight, 1e-5), plain.rms_norm(x, weight, 1e-5))
    got, got_residual = fused.add_rms_norm(x.clone(), residual, weight, 1e-5)
    want, want_residual = plain.add_rms_norm(x.clone(), residual, weight, 1e-5)
    assert same(got, want) and torch.equal(got_residual, want_residual)
    gate_up = torch.randn(7, 2 * 1536, generator=gen).to(dtype)
    assert torch.equal(fused.silu_and_mul(gate_up), plain.silu_and_mul(gate_up))
    # Strided heads (q / k norms of Qwen3 read views of the qkv output).
    heads = torch.randn(5, 12, 64, generator=gen).to(dtype)[:, 2:9]
    head_weight = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    assert same(fused.rms_norm(heads, head_weight, 1e-6),
                plain.rms_norm(heads, head_weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_equals_the_torch_rotation(dtype: torch.dtype) -> None:
    ops = require_cpu_ops()
    args = (64, 4096, 100000.0, None, dtype, torch.device("cpu"))
    fused, plain = RotaryEmbedding(*args, ops), RotaryEmbedding(*args)
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 77, 1999, 4095])
    cos, sin = plain.lookup(positions)
    qk = torch.randn(5, 12, 64, generator=gen).to(dtype)
    want = plain.apply(qk.clone(), cos, sin)
    view = qk.clone()[:, :9]                  # rotated in place through a strided view
    got = fused.apply(view, cos, sin)
    assert torch.equal(got, want[:, :9])


def test_built_kernels_load_without_running_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    # A restart must not hand the kernels to ninja, which rebuilds (~45 s) whenever the
    # sources' paths or mtimes changed (a git pull) though their contents did not.
    from torch.utils import cpp_extension

    from kernels import cpu_ops
    from services.worker.runner.cpu_runtime import cpu_kernels_dir

    require_cpu_ops()   # built once

    def no_build(*_: object, **__: object) -> None:
        raise AssertionError("the build ran for kernels already built")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    cpu_ops._load.cache_clear()
    try:
        ops = cpu_ops.load(cpu_kernels_dir())
        assert ops is not None and ops.vec_size > 0
    finally:
        cpu_ops._load.cache_clear()
