"""Keeps a GGUF model's quantized blocks beside its converted fp32 weights.

When a GGUF file is converted (model_files.py), each linear weight stored in a block format
the worker's CPU kernel reads (Q4_1, Q8_0) is also saved, as its blocks, to
`gguf_blocks.safetensors` under the HF weight name: `<name>.scales` and, for Q4_1,
`<name>.mins` (fp32 [N, K/32], widened from GGUF's fp16), and `<name>.quants` (uint8 [N, K/2]
nibbles in GGUF order, or [N, K] int8 for Q8_0), with q and k rows in the order transformers
gives them. The worker reads these for small fp32 batches (services/worker/models/quantized.py)
after checking they expand to the loaded fp32 weights bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BLOCKS_FILE = "gguf_blocks.safetensors"
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}   # fp16 scale (+ fp16 min), then 32 quants
_LAYER_WEIGHTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def export_gguf_blocks(gguf: Path, target: Path, num_heads: int, num_kv_heads: int) -> int:
    """Writes target/BLOCKS_FILE; returns how many weights it holds (0: none, no file)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for tensor in GGUFReader(str(gguf)).tensors:
        kind = tensor.tensor_type.name
        name = hf_weight_name(tensor.name)
        if name is None or kind not in BLOCK_BYTES:
            continue
        scales, mins, quants = _unpack(np.asarray(tensor.data), kind)
        short = tensor.name.split(".")[-2]
        if short in ("attn_q", "attn_k"):
            # NOTE: llama.cpp stores q and k rows interleaved for its rope; transformers
            # undoes that at load, and so do we.
            order = _reverse_permutation(len(scales), num_heads if short == "attn_q"
                                         else num_kv_heads)
            scales, mins, quants = scales[order], mins[order] if mins.size else mins, quants[order]
        tensors[f"{name}.scales"], tensors[f"{name}.quants"] = scales, quants
        if mins.size:
            tensors[f"{name}.mins"] = mins
    if tensors:
        save_file(tensors, str(target / BLOCKS_FILE))
    return sum(1 for key in tensors if key.endswith(".scales"))


def hf_weight_name(gguf_name: str) -> str | None:
    """'blk.3.ffn_up.weight' -> 'layers.3.mlp.up_proj.weight' (None: not a linear weight)."""
    if gguf_name == "token_embd.weight":
        return "embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        return None
    module = _LAYER_WEIGHTS.get(parts[2])
    return f"layers.{parts[1]}.{module}.weight" if module else None


def _unpack(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[kind])

    def fp16_as_fp32(columns: slice) -> np.ndarray:
        return np.ascontiguousarray(blocks[:, :, columns]).view(np.float16)[..., 0] \
            .astype(np.float32)

    if kind == "Q4_1":
        mins, quants = fp16_as_fp32(slice(2, 4)), blocks[:, :, 4:]
    else:
        mins, quants = np.empty(0, np.float32), blocks[:, :, 2:]
    return fp16_as_fp32(slice(0, 2)), mins, np.ascontiguousarray(quants).reshape(n, -1)


def _reverse_permutation(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rope permutation of a q or k weight."""
    index = np.arange(num_rows)
    return index.reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)
