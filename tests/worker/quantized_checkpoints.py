"""Tiny Llama checkpoints quantized by the tests themselves, in the on-disk formats users
download (compressed-tensors int8 / FP8, GPTQ, AWQ), written with torch and numpy only.

Each quantizer turns a dense weight W [N, K] into the tensors its format stores for that
linear and the dense weight those tensors stand for (computed here from the integer codes
and the stored scales, not by the worker's readers). save_quantized writes the checkpoint and
returns the HF model holding those dequantized weights: the reference the worker must match.
The packers are written apart from the worker's unpackers (numpy loops over bit slots) so that
a pack / unpack round trip checks one against the other.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

from tests.worker.models.hf_compare import TINY, save_tiny_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ's order_map: bit slot j holds column order[j]
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class QuantizedLinear:
    tensors: dict[str, torch.Tensor]   # by suffix ("weight", "weight_scale", "qweight", ...)
    dense: torch.Tensor                # fp32 [N, K]: what the stored tensors stand for


Quantizer = Callable[[torch.Tensor], QuantizedLinear]


def pack_int4(codes: np.ndarray, along_rows: bool,
              order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """codes (0..15) -> int32 words of 8: along rows (word [r, c] holds rows 8r..8r+7) or
    columns; bit slot j (bits 4j..4j+3) holds the word's element order[j]."""
    codes = codes.astype(np.uint32)
    if along_rows:
        codes = codes.T
    rows, cols = codes.shape
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for slot, element in enumerate(order):
        words |= codes[:, element::8] << np.uint32(4 * slot)
    return (words.T if along_rows else words).copy().view(np.int32)


def int8_channel(w: torch.Tensor) -> QuantizedLinear:
    """Symmetric int8 per output channel, scales stored in bf16 (as llm-compressor writes the
    model dtype)."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16)
    codes = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
    return QuantizedLinear({"weight": codes, "weight_scale": scale},
                           codes.float() * scale.float())


def fp8(per_channel: bool) -> Quantizer:
    def quantize(w: torch.Tensor) -> QuantizedLinear:
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = amax / torch.finfo(torch.float8_e4m3fn).max
        codes = (w / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
        return QuantizedLinear({"weight": codes, "weight_scale": scale},
                               codes.float() * scale.reshape(-1, 1))
    return quantize


def group_ids(num_rows: int, group_size: int, act_order: bool) -> torch.Tensor:
    """Each input row's group: consecutive rows, or (act order) rows in a seeded shuffle."""
    size = num_rows if group_size == -1 else group_size
    if not act_order:
        return torch.arange(num_rows, dtype=torch.int32) // size
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(num_rows))
    g_idx = torch.empty(num_rows, dtype=torch.int32)
    g_idx[perm] = torch.arange(num_rows, dtype=torch.int32) // size
    return g_idx


def int4_codes(w: torch.Tensor, g_idx: torch.Tensor,
               sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [K, N], zeros [G, N], fp16 scales [G, N], dense fp32 [N, K]) of W [N, K]:
    min-max per group and output column (sym: zero 8). Output row 0 is made non-negative,
    so its asymmetric zero points are 0 (GPTQ v1 stores those as 15)."""
    wt = w.t().clone()
    wt[:, 0] = wt[:, 0].abs()
    num_groups = int(g_idx.max()) + 1
    scales = torch.empty(num_groups, wt.shape[1])
    zeros = torch.empty(num_groups, wt.shape[1])
    for g in range(num_groups):
        rows = wt[g_idx == g]
        if sym:
            scales[g] = rows.abs().amax(0) * 2 / 15
            zeros[g] = 8
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = (hi - lo) / 15
            zeros[g] = torch.round(-lo / scales[g]).clamp(0, 15)
    scales = scales.to(torch.float16)
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    codes = (torch.round(wt / s) + z).clamp(0, 15)
    return codes.int(), zeros.int(), scales, ((codes - z) * s).t().contiguous()


def gptq(group_size: int, sym: bool, act_order: bool, v1: bool = True) -> Quantizer:
    def quantize(w: torch.Tensor) -> QuantizedLinear:
        g_idx = group_ids(w.shape[1], group_size, act_order)
        codes, zeros, scales, dense = int4_codes(w, g_idx, sym)
        stored_zeros = (zeros - 1) & 0xF if v1 else zeros
        return QuantizedLinear({
            "qweight": torch.from_numpy(pack_int4(codes.numpy(), along_rows=True)),
            "qzeros": torch.from_numpy(pack_int4(stored_zeros.numpy(), along_rows=False)),
            "scales": scales, "g_idx": g_idx}, dense)
    return quantize


def awq(group_size: int) -> Quantizer:
    def quantize(w: torch.Tensor) -> QuantizedLinear:
        codes, zeros, scales, dense = int4_codes(w, group_ids(w.shape[1], group_size, False),
                                                 sym=False)
        return QuantizedLinear({
            "qweight": torch.from_numpy(pack_int4(codes.numpy(), False, AWQ_ORDER)),
            "qzeros": torch.from_numpy(pack_int4(zeros.numpy(), False, AWQ_ORDER)),
            "scales": scales}, dense)
    return quantize


def compressed_tensors_config(weight_type: str, weight_strategy: str,
                              activations: dict[str, Any] | None) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": f"{weight_type}-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": activations,
                "weights": {"num_bits": 8, "type": weight_type, "symmetric": True,
                            "strategy": weight_strategy, "dynamic": False}}}}


def dynamic_token_activations(weight_type: str) -> dict[str, Any]:
    return {"num_bits": 8, "type": weight_type, "symmetric": True, "strategy": "token",
            "dynamic": True}


def tiny_llama(directory: Path) -> transformers.PreTrainedModel:
    """The random fp32 Llama (2 layers, untied lm_head) saved dense to `directory`."""
    config = transformers.LlamaConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False)
    return save_tiny_checkpoint(config, directory)


def save_quantized(hf: transformers.PreTrainedModel, directory: Path, quantize: Quantizer,
                   quantization_config: dict[str, Any]) -> transformers.PreTrainedModel:
    """Rewrites hf's checkpoint in `directory` with every decoder linear quantized (the
    lm_head and embeddings stay dense, as the formats' tools leave them) and its
    quantization_config; returns a copy of hf holding the dequantized weights."""
    stored, dense = {}, {}
    for name, tensor in hf.state_dict().items():
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] not in DECODER_LINEARS:
            stored[name] = tensor.contiguous()
            continue
        quantized = quantize(tensor)
        stored.update({f"{prefix}.{suffix}": t.contiguous()
                       for suffix, t in quantized.tensors.items()})
        dense[name] = quantized.dense
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "quantization_config": quantization_config}))
    reference = copy.deepcopy(hf)
    reference.load_state_dict(dense, strict=False)
    return reference
