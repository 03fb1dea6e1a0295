"""M-RoPE positions against HF's get_rope_index, and the rotation against HF's rope."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.qwen2_vl import modeling_qwen2_vl

from services.worker.models.rotary import RotaryEmbedding
from services.worker.models.vision.mrope import (
    MRotaryEmbedding, mrope_decode_positions, mrope_positions, mrope_section_from_hf)
from services.worker.models.vision.qwen2_vl_grid import num_image_tokens
from tests.worker.vision.tiny_vlms import (
    IMAGE_TOKEN_ID, MROPE_SECTION, VISION_END_ID, VISION_START_ID, qwen2_5_vl_config,
    qwen2_vl_config)

CPU = torch.device("cpu")
GRIDS = [[1, 4, 6], [1, 8, 6]]   # two images: 6 and 12 placeholder tokens
HEAD_DIM = 16


def prompt_with_images(grids: list[list[int]]) -> list[int]:
    """text <|vision_start|> <|image_pad|> * n <|vision_end|> text ... (the chat template's
    layout, placeholders expanded as the HF processor would)."""
    ids = [1, 17, 18, 19]
    for i, grid in enumerate(grids):
        ids += [VISION_START_ID] + [IMAGE_TOKEN_ID] * num_image_tokens(grid, 2)
        ids += [VISION_END_ID] + list(range(30 + i, 33 + 2 * i))
    return ids + [40, 41]


def hf_rope_index(config: Any, model_cls: type, ids: list[int],
                  grids: list[list[int]]) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    token_types = (input_ids == IMAGE_TOKEN_ID).int()
    positions, deltas = model_cls(config).get_rope_index(
        input_ids, token_types, image_grid_thw=torch.tensor(grids))
    return positions[:, 0], int(deltas)


@pytest.mark.parametrize("config_fn, model_cls", [
    (qwen2_vl_config, transformers.Qwen2VLModel),
    (qwen2_5_vl_config, transformers.Qwen2_5_VLModel)], ids=["qwen2_vl", "qwen2_5_vl"])
def test_positions_equal_hf_get_rope_index(config_fn: Any, model_cls: type) -> None:
    ids = prompt_with_images(GRIDS)
    want, want_delta = hf_rope_index(config_fn(), model_cls, ids, GRIDS)
    got, delta = mrope_positions(ids, IMAGE_TOKEN_ID, torch.tensor(GRIDS), 2)
    assert torch.equal(got, want)
    assert delta == want_delta < 0          # images span fewer positions than tokens
    # Decode: HF continues at arange(cache length, ...) + delta in all three rows.
    n = len(ids)
    assert torch.equal(mrope_decode_positions(delta, n, n + 3),
                       (torch.arange(n, n + 3) + want_delta).expand(3, -1))


def test_text_only_prompt_is_plain_positions() -> None:
    positions, delta = mrope_positions([5, 6, 7], IMAGE_TOKEN_ID, [], 2)
    assert torch.equal(positions, torch.arange(3).expand(3, -1)) and delta == 0


@pytest.mark.parametrize("grids, ids", [
    (GRIDS, prompt_with_images(GRIDS[:1])),                           # fewer runs than grids
    (GRIDS[:1], prompt_with_images(GRIDS)),                           # more placeholders
    ([[1, 4, 8]], prompt_with_images(GRIDS[:1])),                     # run too short
])
def test_placeholders_not_matching_grids_raise(grids: list[list[int]], ids: list[int]) -> None:
    with pytest.raises(ValueError):
        mrope_positions(ids, IMAGE_TOKEN_ID, grids, 2)


def test_rotation_equals_hf_multimodal_rope() -> None:
    """HF rotates by Qwen2VLRotaryEmbedding (mrope_section recomposed) + apply_rotary_pos_emb."""
    config = qwen2_vl_config().text_config
    ids = prompt_with_images(GRIDS)
    positions, _ = mrope_positions(ids, IMAGE_TOKEN_ID, GRIDS, 2)
    num_tokens, num_heads = positions.shape[1], 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, 2, HEAD_DIM, generator=gen)

    hf_rope = modeling_qwen2_vl.Qwen2VLRotaryEmbedding(config)
    cos, sin = hf_rope(q, positions[:, None, :])            # [1, T, D]
    want_q, want_k = modeling_qwen2_vl.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    rope = MRotaryEmbedding(HEAD_DIM, 512, 10000.0, MROPE_SECTION, torch.float32, CPU)
    cos, sin = rope.lookup(positions)
    assert cos.shape == (num_tokens, 1, HEAD_DIM)
    torch.testing.assert_close(rope.apply(q, cos, sin), want_q[0].transpose(0, 1),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.apply(k, cos, sin), want_k[0].transpose(0, 1),
                               rtol=1e-6, atol=1e-6)


def test_equal_rows_rotate_as_plain_rope() -> None:
    rope = MRotaryEmbedding(HEAD_DIM, 64, 10000.0, MROPE_SECTION, torch.float32, CPU)
    plain = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None, torch.float32, CPU)
    positions = torch.tensor([0, 3, 9, 40])
    for got, want in zip(rope.lookup(positions.expand(3, -1)), plain.lookup(positions)):
        assert torch.equal(got, want)
    for got, want in zip(rope.lookup(positions), plain.lookup(positions)):
        assert torch.equal(got, want)


def test_mrope_section_from_both_config_layouts() -> None:
    assert mrope_section_from_hf(qwen2_vl_config().to_dict()) == MROPE_SECTION
    legacy = {"model_type": "qwen2_vl",
              "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    assert mrope_section_from_hf(legacy) == [16, 24, 24]
    with pytest.raises(ValueError):
        MRotaryEmbedding(HEAD_DIM, 64, 10000.0, [2, 2, 2], torch.float32, CPU)
