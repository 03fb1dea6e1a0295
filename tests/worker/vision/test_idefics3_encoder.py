"""The Idefics3 / SmolVLM vision tower and connector against HF's get_image_features, fp32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from services.worker.models.vision.idefics3 import drop_padding_images, pixel_shuffle
from services.worker.models.vision.registry import load_vision_encoder
from tests.worker.vision.tiny_vlms import build, idefics3_config, noise_images

CPU = torch.device("cpu")
MODELS = {
    "idefics3": (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration,
                 transformers.Idefics3ImageProcessorPil),
    "smolvlm": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration,
                transformers.SmolVLMImageProcessorPil),
}
TOKENS_PER_SUB_IMAGE = 4   # (32 px / 8 px patches / scale 2) ** 2


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    config_cls, model_cls, processor_cls = MODELS[request.param]
    hf = build(model_cls, idefics3_config(config_cls))
    # Images up to 64 px, cut into 32 px tiles plus the whole image at 32 px.
    processor = processor_cls(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    return hf, processor


def hf_embeddings(hf: Any, pixel_values: torch.Tensor,
                  pixel_attention_mask: torch.Tensor) -> torch.Tensor:
    """HF's embeddings of a one-sample batch: [num_sub_images * tokens, hidden]."""
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values, pixel_attention_mask)
    assert len(out.pooler_output) == 1
    return out.pooler_output[0]


@pytest.mark.parametrize("sizes", [[(56, 84)], [(56, 84), (40, 30)]],
                         ids=["one_image", "two_images"])
def test_encoder_equals_hf(model: tuple[Any, Any], sizes: list[tuple[int, int]]) -> None:
    hf, processor = model
    inputs = processor(images=[noise_images(sizes)], return_tensors="pt")
    encoder = load_vision_encoder(hf.config.to_dict(), hf.state_dict(), torch.float32, CPU)
    pixel_values, mask = drop_padding_images(inputs["pixel_values"],
                                             inputs["pixel_attention_mask"])
    got = encoder.encode(pixel_values, mask)
    assert len(got) == pixel_values.shape[0] > len(sizes)   # tiles and the global image
    assert all(g.shape == (TOKENS_PER_SUB_IMAGE, hf.config.text_config.hidden_size)
               for g in got)
    want = hf_embeddings(hf, inputs["pixel_values"], inputs["pixel_attention_mask"])
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)


def test_padded_images_equal_hf(model: tuple[Any, Any]) -> None:
    """Images padded to the batch's size: real patches bucketed over the position table,
    padding patches masked as keys (this path differs from an unmasked run)."""
    hf, _ = model
    mask = torch.zeros(1, 2, 32, 32, dtype=torch.long)
    mask[0, 0, :24, :16] = 1
    mask[0, 1, :, :8] = 1
    pixel_values = torch.randn(1, 2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    pixel_values = pixel_values * mask[:, :, None]
    encoder = load_vision_encoder(hf.config.to_dict(), hf.state_dict(), torch.float32, CPU)
    got = torch.cat(encoder.encode(pixel_values[0], mask[0]))
    want = hf_embeddings(hf, pixel_values, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unmasked = torch.cat(encoder.encode(pixel_values[0], None))
    assert (unmasked - want).abs().max() > 1e-2


def test_pixel_shuffle_equals_hf_connector(model: tuple[Any, Any]) -> None:
    hf, _ = model
    states = torch.randn(3, 64, 5)
    want = hf.model.connector.pixel_shuffle(states, 2)
    assert torch.equal(pixel_shuffle(states, 2), want)


def test_drop_padding_images() -> None:
    pixel_values = torch.randn(2, 3, 3, 4, 4)
    pixel_values[0, 2] = 0
    pixel_values[1, 1:] = 0
    mask = torch.ones(2, 3, 4, 4)
    real, real_mask = drop_padding_images(pixel_values, mask)
    assert torch.equal(real, torch.stack([pixel_values[0, 0], pixel_values[0, 1],
                                          pixel_values[1, 0]]))
    assert real_mask is not None and real_mask.shape == (3, 4, 4)


def test_bf16_tower_stays_close_to_fp32_hf(model: tuple[Any, Any]) -> None:
    hf, _ = model
    pixel_values = torch.randn(1, 3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    encoder = load_vision_encoder(hf.config.to_dict(), hf.state_dict(), torch.bfloat16, CPU)
    got = torch.cat(encoder.encode(pixel_values[0]))
    want = hf_embeddings(hf, pixel_values, torch.ones(1, 3, 32, 32, dtype=torch.long))
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.03 * want.abs().max()
