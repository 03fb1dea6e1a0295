"""The W8A8 int8 path (--quantization int8, services/worker/models/int8.py).

The C++ passes (kernels/cpu/quant_int8.cpp) equal their torch reference bit for bit, and that
reference is a real per-row symmetric quantizer; an Int8Linear stays within the error its two
roundings allow of the float linear, whichever GEMM runs it; SmoothQuant's folding leaves the
float model as it was and brings int8's logprobs closer to fp32's; the runner with int8 starts
its greedy output as fp32 does on prompts with a clear answer (benchmarks/int8.py measures the
rest); and a name we do not know, or int8 on CUDA, is a clear error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.common import wire
from services.common.model_files import resolve_model
from services.worker.kv.connector import kv_fingerprint
from services.worker.kv.kv_cache import KVCacheSpec
from services.worker.models import int8
from services.worker.models.int8 import Int8Linear, Int8Ops, quantize_weight
from services.worker.models.layer_ops import TorchLayerOps
from services.worker.models.smoothing import SmoothedWeights
from services.worker.models.weights import WeightSource
from services.worker.runner import model_loader
from services.worker.runner.config import RunnerConfig
from services.worker.runner.model_runner import ModelRunner
from tests.reference import hf_model
from tests.worker.cpu_kernels import num_threads, require_cpu_ops
from tests.worker.driver import StepDriver

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of different magnitudes (one all zero), with an outlier per row."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4
    x[:, 3] *= 20
    x[0] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_point", [0, 128])
def test_quantize_per_token_equals_the_torch_reference(dtype: torch.dtype,
                                                       zero_point: int) -> None:
    ops = require_cpu_ops()
    for m, k in [(1, 576), (5, 37), (40, 1536)]:   # 37: a tail shorter than a vector
        x = rows(m, k, dtype)
        q, scales = ops.quantize_per_token(x, zero_point)
        want_q, want_scales = Int8Ops.quantize_per_token(x, zero_point)
        assert q.dtype == (torch.uint8 if zero_point else torch.int8)
        assert torch.equal(q, want_q) and torch.equal(scales, want_scales)


def test_the_reference_is_a_symmetric_per_row_quantizer() -> None:
    x = rows(6, 200, torch.float32)
    q, scales = Int8Ops.quantize_per_token(x)
    assert scales[0] == 0 and not q[0].any()                     # a zero row stays zero
    assert torch.equal(q[1:].abs().amax(dim=1), torch.full((5,), 127, dtype=torch.int8))
    assert torch.equal(scales, x.abs().amax(dim=1) / 127)
    error = (q.float() * scales[:, None] - x).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-6)).all()    # round to nearest
    shifted, _ = Int8Ops.quantize_per_token(x, 128)
    assert torch.equal(shifted.int() - 128, q.int())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_dequantize_int32_equals_the_torch_reference(dtype: torch.dtype,
                                                     has_bias: bool) -> None:
    ops = require_cpu_ops()
    generator = torch.Generator().manual_seed(1)
    # 4100 columns: rows split into pieces of 4096 (and a tail) across threads.
    for m, n in [(1, 49), (3, 4100)]:
        acc = torch.randint(-2**26, 2**26, (m, n), dtype=torch.int32, generator=generator)
        x_scales, w_scales = torch.rand(m, generator=generator), torch.rand(n, generator=generator)
        bias = torch.randn(n, generator=generator) if has_bias else None
        want = Int8Ops.dequantize_int32(acc, x_scales, w_scales, bias, dtype)
        with num_threads(2):
            got = ops.dequantize_int32(acc, x_scales, w_scales, bias, dtype)
            # The same sums handed over as fp32 (oneDNN's output) give the same result.
            from_float = ops.dequantize_int32(acc.float(), x_scales, w_scales, bias, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, want) and torch.equal(from_float, want)


def error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|x W^T - x' W'^T| elementwise, at most, where x' and W' are x and W rounded to their
    int8 grids (steps s_x per row, s_w per output channel: each value off by at most half a
    step): sum_k |x| s_w / 2 + |w| s_x / 2 + s_x s_w / 4, with 1% for fp32 rounding."""
    s_x = x.float().abs().amax(dim=1, keepdim=True) / 127
    s_w = weight.abs().amax(dim=1) / 127
    k = x.shape[1]
    bound = (x.float().abs().sum(1, keepdim=True) * s_w / 2 + s_x / 2 * weight.abs().sum(1)
             + k * s_x * s_w / 4)
    return bound * 1.01 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_within_its_rounding_error_of_the_float_linear(
        dtype: torch.dtype) -> None:
    require_cpu_ops()
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(3072, 576, generator=generator) * 0.05
    bias = torch.randn(3072, generator=generator)
    x = torch.randn(32, 576, generator=generator).to(dtype)
    linear = Int8Linear(weight, bias, kernels=require_cpu_ops())
    y = linear(x)
    exact = x.double() @ weight.double().T + bias.double()
    assert y.dtype == dtype and y.shape == (32, 3072)
    # 16-bit outputs add one rounding of the result (half an ulp: 2^-8 of it).
    slack = exact.abs() * (2**-8 if dtype == torch.bfloat16 else 0)
    assert ((y.double() - exact).abs() <= error_bound(x, weight) + slack).all()
    # On Gaussian data the typical error is ~1% of the product (the bound is ~10x that).
    relative = (y.double() - exact).norm() / (exact - bias.double()).norm()
    assert relative < 0.02


def test_every_gemm_and_the_torch_fallback_give_the_same_outputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ops = require_cpu_ops()
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator)
    x = torch.randn(7, 96, generator=generator)
    y = Int8Linear(weight, bias, kernels=ops)(x)
    assert torch.equal(Int8Linear(weight, bias, kernels=None)(x), y)   # torch's passes
    monkeypatch.setattr(int8, "_try_onednn_pack", lambda _: None)      # torch._int_mm
    fallback = Int8Linear(weight, bias, kernels=ops)
    assert fallback.weight is not None and torch.equal(fallback(x), y)
    # A row's result does not depend on the rows beside it.
    assert all(torch.equal(fallback(x[i:i + 1]), y[i:i + 1]) for i in range(7))


def test_weights_are_quantized_per_output_channel() -> None:
    weight = torch.randn(8, 64) * torch.arange(1, 9)[:, None]
    q, scales = quantize_weight(weight)
    assert torch.equal(scales, weight.abs().amax(dim=1) / 127)
    assert q.dtype == torch.int8 and (q.abs().amax(dim=1) == 127).all()


def test_unknown_quantization_or_int8_on_cuda_is_a_clear_error() -> None:
    model_dir = resolve_model("").hf_dir
    with pytest.raises(ValueError, match="unknown --quantization 'int4'"):
        RunnerConfig(model_dir=model_dir, quantization="int4")
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        RunnerConfig(model_dir=model_dir, quantization="int8", device="cuda")
    # --device auto that lands on an accelerator: refused where the weights are.
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        Int8Linear(torch.empty(4, 4, device="meta"))


@pytest.mark.slow
def test_greedy_int8_starts_as_fp32_on_prompts_with_a_clear_answer() -> None:
    """benchmarks/int8.py: int8 agrees with fp32 for 0 to 32 leading tokens depending on the
    prompt (per-token int8 activations move logits by up to ~1.5 here: a row's largest value
    is 10-25x its RMS, so the int8 step is coarse). These tokens lead fp32's runner-up by
    2.5-4.7 logits, and int8 with either activation dtype keeps them."""
    _, tokenizer = hf_model()
    prompts = [tokenizer(p)["input_ids"] for p in
               ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]]
    leading = [1, 1, 8]

    def generate(**config) -> tuple[ModelRunner, list[list[int]]]:
        runner = ModelRunner(RunnerConfig(model_dir=resolve_model("").hf_dir,
                                          max_model_len=256, kv_cache_memory=64 * 2**20,
                                          max_num_seqs=4, **config))
        driver = StepDriver(runner)
        handles = [driver.add(p, max(leading), stop_at_eos=False) for p in prompts]
        outputs = driver.run()
        return runner, [outputs[h] for h in handles]

    _, fp32 = generate()
    scales = []
    for dtype in ("float32", "bfloat16"):
        runner, ours = generate(dtype=dtype, quantization="int8")
        linears = [lin for layer in runner.model.layers for lin in layer.linears]
        assert all(isinstance(lin, Int8Linear) for lin in [*linears, runner.model.lm_head])
        scales.append(runner.model.layers[0].gate_up_proj.weight_scales)
        for n, mine, theirs in zip(leading, ours, fp32):
            assert mine[:n] == theirs[:n], (dtype, mine, theirs)
    # The int8 weights come from the fp32 values whatever the model dtype.
    assert torch.equal(*scales)


def test_an_int8_engine_names_its_kv_blocks_apart_from_the_unquantized_model() -> None:
    """Its KV differs, so a kvstore shared with an unquantized engine must not mix them."""
    model_dir = resolve_model("").hf_dir
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)
    plain = kv_fingerprint(model_dir, spec)
    assert kv_fingerprint(model_dir, spec, "int8") != plain
    assert kv_fingerprint(model_dir, spec, "none") == plain


@pytest.mark.slow
def test_smoothing_leaves_the_float_model_as_it_was() -> None:
    """Folded into the norms and up_proj's rows, the scales cancel: each layer's q/k/v and MLP
    give what the checkpoint's weights give, while the inputs the int8 steps see are flatter."""
    model_dir = resolve_model("").hf_dir
    plain = WeightSource(model_dir, torch.float32, torch.device("cpu"))
    smoothed = SmoothedWeights(model_dir, torch.float32, torch.device("cpu"), num_layers=30)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(0))
    ops = TorchLayerOps()
    for i in (0, 17, 29):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        qkv = [attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj")]
        gate, up, down = (mlp + p + "_proj.weight" for p in ("gate", "up", "down"))

        def block(w: WeightSource) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h = ops.rms_norm(x, w.get(f"layers.{i}.input_layernorm.weight"), 1e-5)
            g = ops.rms_norm(x, w.get(f"layers.{i}.post_attention_layernorm.weight"), 1e-5)
            act = F.silu(g @ w.get(gate).T) * (g @ w.get(up).T)
            return h, h @ w.get_fused(qkv).T, act @ w.get(down).T

        (h0, qkv0, mlp0), (h1, qkv1, mlp1) = block(plain), block(smoothed)
        torch.testing.assert_close(qkv1, qkv0, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mlp1, mlp0, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(h1, h0)   # the scales did move something

        def peak_to_rms(t: torch.Tensor) -> float:
            return (t.abs().amax(-1) / t.pow(2).mean(-1).sqrt()).mean().item()

        assert peak_to_rms(h1) < peak_to_rms(h0)


@pytest.mark.slow
def test_smoothing_brings_int8_logprobs_closer_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a text the calibration never saw, int8's prompt logprobs stray less from fp32's
    with the scales folded in than without (benchmarks/int8.py: perplexity +1.2% against +3.6%)."""
    _, tokenizer = hf_model()
    text = ("The committee met on Tuesday to discuss the new budget. Several members objected "
            "to the cuts in the library's hours, arguing that students rely on the evening "
            "opening during examinations. After a long debate, the chair proposed a compromise.")
    token_ids = tokenizer(text)["input_ids"]

    def logprobs(**config) -> torch.Tensor:
        runner = ModelRunner(RunnerConfig(model_dir=resolve_model("").hf_dir, max_model_len=256,
                                          kv_cache_memory=64 * 2**20, max_num_seqs=1, **config))
        driver = StepDriver(runner)
        handle = driver.add(token_ids, 1, sampling=wire.SamplingParams(prompt_logprobs=0))
        driver.run()
        return torch.tensor([lp for _, lp in driver.requests[handle].prompt_logprobs])

    fp32 = logprobs()
    smoothed = logprobs(quantization="int8")
    monkeypatch.setattr(model_loader, "uses_int8_smoothing", lambda *_: False)
    plain = logprobs(quantization="int8")
    assert (smoothed - fp32).abs().mean() < (plain - fp32).abs().mean()
