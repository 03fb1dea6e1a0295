"""Tiny random vision-language models built from their HF config classes, and noise images.

Every parameter is drawn afresh (seeded), norms included: a fresh LayerNorm is all ones and
zeros, which would hide a norm loaded from the wrong name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

# Placeholder ids inside the tiny vocabulary.
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 250, 251, 252, 253
TEXT: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
# head_dim 16: mrope_section sums to head_dim / 2.
MROPE_SECTION = [2, 3, 3]
QWEN_TOKENS = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                   vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)


def qwen2_vl_config() -> transformers.Qwen2VLConfig:
    text = dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           mrope_section=MROPE_SECTION))
    vision = dict(depth=2, embed_dim=32, hidden_size=TEXT["hidden_size"], num_heads=4,
                  mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **QWEN_TOKENS)


def qwen2_5_vl_config() -> transformers.Qwen2_5_VLConfig:
    text = dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           mrope_section=MROPE_SECTION))
    # window_size 56 px = 2 x 2 merge blocks a window; block 1 attends to the whole image.
    vision = dict(depth=3, hidden_size=32, out_hidden_size=TEXT["hidden_size"],
                  intermediate_size=48, num_heads=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                         **QWEN_TOKENS)


def idefics3_config(config_cls: type = transformers.Idefics3Config) -> Any:
    """Idefics3 / SmolVLM: 32 px images of 8 px patches, 4 x 4 patches -> 4 tokens each."""
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    return config_cls(text_config=dict(model_type="llama", **TEXT), vision_config=vision,
                      scale_factor=2, image_token_id=IMAGE_TOKEN_ID)


def build(model_cls: type, config: Any) -> Any:
    """The model in fp32 eval mode, every parameter random (seeded)."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2
                        + (1.0 if param.dim() == 1 else 0.0) * 0.5)
    return model


def noise_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    """RGB noise images of the given (height, width)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
