"""docs/hybrid_models.md's byte counts are code too: each Mamba2 state size and attention block
size it states is what Mamba2Shape and vLLM's page rule give for that config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.worker.models.mamba2 import Mamba2Shape

DOC = Path(__file__).resolve().parents[2] / "docs/hybrid_models.md"
BLOCK_ALIGNMENT = 16

# (name, shape, conv/model dtype, SSM dtype, attention bytes per token per layer,
#  state bytes per layer, attention block size)
CASES = [
    ("tiny", Mamba2Shape(64, 8, 16, 16, 2, 4, 8), torch.float32, torch.float32, 2 * 2 * 16 * 4,
     10_496, 48),
    ("bamba_9b", Mamba2Shape(4096, 128, 64, 128, 1, 4, 256), torch.bfloat16, torch.bfloat16,
     2 * 8 * 128 * 2, 2_147_840, 528),
    ("bamba_9b_fp32_ssm", Mamba2Shape(4096, 128, 64, 128, 1, 4, 256), torch.bfloat16,
     torch.float32, 2 * 8 * 128 * 2, 4_244_992, 1040),
    ("nemotron_nano_12b_v2", Mamba2Shape(5120, 128, 80, 128, 8, 4, 128), torch.bfloat16,
     torch.bfloat16, 2 * 8 * 128 * 2, 2_695_168, 672),
]


@pytest.mark.parametrize("name,shape,dtype,ssm_dtype,attn_bytes,state_bytes,block_size", CASES,
                         ids=[case[0] for case in CASES])
def test_the_doc_states_each_state_and_block_size(name, shape, dtype, ssm_dtype, attn_bytes,
                                                   state_bytes, block_size) -> None:
    assert shape.state_bytes(dtype, ssm_dtype) == state_bytes
    # vLLM: the attention block grows (in steps of the kernels' alignment) until one layer's
    # block holds a Mamba layer's state.
    steps = math.ceil(state_bytes / (BLOCK_ALIGNMENT * attn_bytes))
    assert BLOCK_ALIGNMENT * steps == block_size
    doc = DOC.read_text()
    assert f"{state_bytes:,}" in doc and f"**{block_size}**" in doc
