"""Checkpoints stored quantized (services/worker/models/checkpoint_quant/), each format written
by the test itself from a tiny random Llama (tests/worker/quantized_checkpoints.py).

The worker's greedy output and every position's logprob are held to HF transformers running
the dequantized weights: within 1e-4 where the worker runs those weights (FP8, GPTQ, AWQ on
the CPU), and within W8A8_ATOL for int8 W8A8, whose per-token int8 activations the reference
reproduces by quantizing each linear's input the same way (Int8Ops' rule). Packing round-trips
against independently written packers; unsupported configs are clear errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from services.worker.models.checkpoint_quant import (
    UnsupportedQuantizationError,
    parse_quantization_config,
)
from services.worker.models.checkpoint_quant.int4_packing import (
    AWQ_ORDER,
    pack_rows,
    unpack_cols,
    unpack_rows,
)
from services.worker.models.checkpoint_quant.int4_weight import Int4Weight
from services.worker.models.checkpoint_quant.reference import fp8_linear
from services.worker.models.int8 import Int8Linear, Int8Ops
from services.worker.models.layers import Linear
from services.worker.runner.cpu_runtime import load_cpu_kernels
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker import quantized_checkpoints as qc
from tests.worker.models.hf_compare import assert_matches_hf

# Logprob tolerance for W8A8: the worker sums int8 products in int32 and scales once, the
# reference multiplies the dequantized values in fp32; the two differ by fp32 rounding, and
# rarely an activation right at a rounding boundary lands one int8 step apart.
W8A8_ATOL = 1e-3

GPTQ = {"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}


class Format(NamedTuple):
    quantize: qc.Quantizer
    config: dict
    atol: float                   # on logprobs
    linear_cls: type = Linear     # what the CPU runs the decoder linears as
    has_blocks: bool = False      # 4-bit blocks for small batches (fp32, groups of 32k rows)


FORMATS = {
    "w8a8_int8": Format(qc.int8_channel, qc.compressed_tensors_config(
        "int", "channel", qc.dynamic_token_activations("int")), W8A8_ATOL, Int8Linear),
    "w8a16_int8": Format(qc.int8_channel,
                         qc.compressed_tensors_config("int", "channel", None), 1e-4),
    "fp8_per_channel": Format(qc.fp8(per_channel=True), qc.compressed_tensors_config(
        "float", "channel", qc.dynamic_token_activations("float")), 1e-4),
    "fp8_per_tensor": Format(qc.fp8(per_channel=False), qc.compressed_tensors_config(
        "float", "tensor", qc.dynamic_token_activations("float")), 1e-4),
    "gptq_sym_g32": Format(qc.gptq(32, sym=True, act_order=False),
                           {**GPTQ, "group_size": 32, "sym": True, "desc_act": False}, 1e-4,
                           has_blocks=True),
    "gptq_asym_g32_act_order": Format(
        qc.gptq(32, sym=False, act_order=True),
        {**GPTQ, "group_size": 32, "sym": False, "desc_act": True}, 1e-4),
    "gptq_v2_asym_per_column": Format(
        qc.gptq(-1, sym=False, act_order=False, v1=False),
        {**GPTQ, "group_size": -1, "sym": False, "desc_act": False,
         "checkpoint_format": "gptq_v2"}, 1e-4, has_blocks=True),
    "awq_g32": Format(qc.awq(32), {**AWQ, "group_size": 32}, 1e-4, has_blocks=True),
    "awq_per_column": Format(qc.awq(-1), {**AWQ, "group_size": -1}, 1e-4, has_blocks=True),
}


def quantize_inputs_per_token(hf: torch.nn.Module) -> None:
    """Each decoder linear of `hf` sees its input as int8 per token would give it back."""
    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        codes, scales = Int8Ops.quantize_per_token(x.reshape(-1, x.shape[-1]))
        return ((codes.float() * scales[:, None]).reshape(x.shape).to(x.dtype),)

    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in qc.DECODER_LINEARS:
            module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_checkpoint_matches_hf_on_its_dequantized_weights(name: str,
                                                                    tmp_path: Path) -> None:
    fmt = FORMATS[name]
    reference = qc.save_quantized(qc.tiny_llama(tmp_path), tmp_path, fmt.quantize, fmt.config)
    if fmt.linear_cls is Int8Linear:
        quantize_inputs_per_token(reference)
    # Prefill chunks of 20 rows run the dense weights, decodes (1 row) the blocks if any.
    assert_matches_hf(reference, tmp_path, atol=fmt.atol, token_budget=20)
    runner = ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20))
    linears = [lin for layer in runner.model.layers for lin in layer.linears]
    assert all(type(lin) is fmt.linear_cls for lin in linears)
    kernels = load_cpu_kernels()
    if fmt.linear_cls is Linear and kernels is not None and kernels.quant_linear_supported():
        assert all((lin.quantized is not None) == fmt.has_blocks for lin in linears)
    assert type(runner.model.lm_head) is Linear and runner.model.lm_head.quantized is None


def test_a_w8a8_checkpoint_runs_its_own_int8_codes(tmp_path: Path) -> None:
    """The Int8Linear holds the checkpoint's codes and scales, not a requantization of them."""
    quantize, config, *_ = FORMATS["w8a8_int8"]
    hf = qc.tiny_llama(tmp_path)
    qc.save_quantized(hf, tmp_path, quantize, config)
    runner = ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20))
    down = runner.model.layers[1].down_proj
    stored = quantize(hf.model.layers[1].mlp.down_proj.weight.detach())
    assert torch.equal(down.weight_scales, stored.tensors["weight_scale"].float().reshape(-1))
    x = torch.randn(3, down.in_features)
    want = Int8Linear(stored.tensors["weight"], None, None,
                      weight_scales=stored.tensors["weight_scale"].float().reshape(-1))(x)
    assert torch.allclose(down(x), want, atol=1e-6)


@pytest.mark.parametrize("num_rows,num_cols", [(8, 4), (64, 24)])
def test_packing_round_trips(num_rows: int, num_cols: int) -> None:
    codes = np.random.default_rng(num_rows).integers(0, 16, (num_rows, num_cols))
    want = torch.from_numpy(codes).int()
    gptq_rows = torch.from_numpy(qc.pack_int4(codes, along_rows=True))
    assert torch.equal(unpack_rows(gptq_rows), want)                        # GPTQ qweight
    assert torch.equal(pack_rows(want), gptq_rows)                           # and our packer
    gptq_cols = torch.from_numpy(qc.pack_int4(codes.T, along_rows=False))
    assert torch.equal(unpack_cols(gptq_cols), want.T)                       # GPTQ qzeros
    awq_cols = torch.from_numpy(qc.pack_int4(codes.T, False, qc.AWQ_ORDER))
    assert torch.equal(unpack_cols(awq_cols, AWQ_ORDER), want.T)             # AWQ both
    assert not torch.equal(unpack_cols(awq_cols), want.T)                    # order matters


def test_int4_weights_fuse_and_make_blocks_only_where_groups_allow() -> None:
    """q/k/v fuse into one Int4Weight only with one g_idx; Q4_1 blocks (32 input rows each)
    exist only where each block's rows share a group, and then hold the same values."""
    def weight(g_idx: torch.Tensor) -> Int4Weight:
        codes, zeros, scales, _ = qc.int4_codes(torch.randn(16, 64), g_idx, sym=False)
        return Int4Weight(pack_rows(codes), zeros.to(torch.uint8), scales, g_idx)

    grouped = [weight(qc.group_ids(64, 32, act_order=False)) for _ in range(2)]
    fused = Int4Weight.cat(grouped)
    assert torch.equal(fused.dequantize(), torch.cat([w.dequantize() for w in grouped]))
    assert torch.equal(fused.to_q4_1().dequantize(), fused.dequantize())
    shuffled = weight(qc.group_ids(64, 32, act_order=True))
    assert shuffled.to_q4_1() is None
    assert Int4Weight.cat([grouped[0], shuffled]) is None


def test_fp8_reference_product_is_within_e4m3_rounding_of_the_dequantized_one() -> None:
    """What running FP8 dequantized (activations unquantized) differs by from the format's
    product: each activation rounded to e4m3 on its row's scale s = max|x| / 448: within 2^-4
    of itself (3 mantissa bits), or s * 2^-10 among the subnormals."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)
    stored = qc.fp8(per_channel=True)(weight)
    x = torch.randn(5, 64, generator=gen) * torch.rand(5, 1, generator=gen) * 10
    got = fp8_linear(x, stored.tensors["weight"], stored.tensors["weight_scale"])
    dense = x @ stored.dense.t()
    step = x.abs().amax(dim=1, keepdim=True) / 448 * 2**-10
    bound = (x.abs() * 2**-4 + step) @ stored.dense.abs().t()
    assert ((got - dense).abs() <= bound * 1.001).all()
    assert not torch.equal(got, dense)


@pytest.mark.parametrize("config,problem", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({**GPTQ, "bits": 8, "group_size": 128}, "gptq with bits 8"),
    ({**GPTQ, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({**AWQ, "version": "gemv", "group_size": 128}, "awq version 'gemv'"),
    ({**AWQ, "zero_point": False, "group_size": 128}, "without zero points"),
    ({**qc.compressed_tensors_config("int", "channel", None), "format": "pack-quantized"},
     "format 'pack-quantized'"),
    (qc.compressed_tensors_config("int", "group", None), "compressed-tensors weights"),
    (qc.compressed_tensors_config("int", "channel", {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
        "dynamic": False}), "input activations"),
])
def test_unsupported_quantization_is_a_clear_error(config: dict, problem: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match="supported quantized checkpoints") \
            as error:
        parse_quantization_config(config)
    assert problem in str(error.value)


def test_a_quantized_checkpoint_refuses_another_quantization(tmp_path: Path) -> None:
    quantize, config, *_ = FORMATS["gptq_sym_g32"]
    qc.save_quantized(qc.tiny_llama(tmp_path), tmp_path, quantize, config)
    with pytest.raises(ValueError, match="stored quantized \\(gptq\\)"):
        ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20,
                                 quantization="int8"))


def test_an_unsupported_checkpoint_fails_at_load(tmp_path: Path) -> None:
    qc.save_quantized(qc.tiny_llama(tmp_path), tmp_path, qc.awq(32),
                      {**AWQ, "group_size": 32, "bits": 3})
    with pytest.raises(UnsupportedQuantizationError, match="awq with bits 3"):
        ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=2**20))
