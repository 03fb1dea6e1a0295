"""The Qwen2-VL / Qwen2.5-VL vision towers against HF's get_image_features, in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import vision_utils

from services.worker.models.vision.qwen2_vl_grid import patch_positions, window_index
from services.worker.models.vision.registry import load_vision_encoder
from services.worker.models.weights import WeightSource
from tests.worker.vision.tiny_vlms import (
    build, noise_images, qwen2_5_vl_config, qwen2_vl_config)

CPU = torch.device("cpu")
MODELS = {
    "qwen2_vl": (qwen2_vl_config, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (qwen2_5_vl_config, transformers.Qwen2_5_VLForConditionalGeneration),
}
# (height, width) in pixels; 28 px = one merged token a side. Grids (in 14 px patches):
# 4 x 6 and 8 x 6, so Qwen2.5-VL's 2 x 2-token windows include partial ones.
ONE_IMAGE = [(56, 84)]
TWO_IMAGES = [(56, 84), (112, 84)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf_model(request: pytest.FixtureRequest) -> Any:
    config_fn, model_cls = MODELS[request.param]
    return build(model_cls, config_fn())


def processor_inputs(sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """What the HF image processor makes of noise images of `sizes` (kept at their size)."""
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28,
                                                       max_pixels=140 * 140)
    return processor(images=noise_images(sizes), return_tensors="pt")


def hf_embeddings(hf: Any, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return list(out.pooler_output)


def assert_same_embeddings(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [ONE_IMAGE, TWO_IMAGES], ids=["one_image", "two_images"])
def test_encoder_equals_hf(hf_model: Any, sizes: list[tuple[int, int]]) -> None:
    inputs = processor_inputs(sizes)
    encoder = load_vision_encoder(hf_model.config.to_dict(), hf_model.state_dict(),
                                  torch.float32, CPU)
    got = encoder.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    want = hf_embeddings(hf_model, inputs)
    assert len(got) == len(sizes)
    assert got[0].shape[1] == hf_model.config.text_config.hidden_size
    assert_same_embeddings(got, want)


def test_both_checkpoint_spellings_load(hf_model: Any) -> None:
    """transformers >= 4.52 names the tower model.visual.*, older checkpoints visual.*."""
    state = hf_model.state_dict()
    assert any(name.startswith("model.visual.") for name in state)
    legacy = {name.replace("model.visual.", "visual."): t for name, t in state.items()}
    inputs = processor_inputs(ONE_IMAGE)
    config = hf_model.config.to_dict()
    new = load_vision_encoder(config, state, torch.float32, CPU)
    old = load_vision_encoder(config, legacy, torch.float32, CPU)
    torch.testing.assert_close(old.encode(inputs["pixel_values"], inputs["image_grid_thw"]),
                               new.encode(inputs["pixel_values"], inputs["image_grid_thw"]),
                               rtol=0, atol=0)


def test_loads_from_a_saved_checkpoint(hf_model: Any, tmp_path: Path) -> None:
    hf_model.save_pretrained(tmp_path)
    source = WeightSource(tmp_path, torch.float32, CPU)
    encoder = load_vision_encoder(hf_model.config.to_dict(), source, torch.float32, CPU)
    inputs = processor_inputs(TWO_IMAGES)
    assert_same_embeddings(encoder.encode(inputs["pixel_values"], inputs["image_grid_thw"]),
                           hf_embeddings(hf_model, inputs))


def test_patch_positions_and_windows_equal_hf() -> None:
    grids = torch.tensor([[1, 4, 6], [1, 8, 6], [2, 6, 10]])
    want = vision_utils.get_vision_position_ids(grids, 2)
    assert torch.equal(patch_positions(grids.tolist(), 2), want)
    order, bounds = window_index(grids.tolist(), 2, 56, 14)
    want_order, want_bounds = vision_utils.get_vision_window_index(grids, 2, 56, 14)
    assert torch.equal(order, want_order)
    assert bounds == want_bounds.tolist()
    assert len(bounds) - 1 > len(grids)   # several windows per image: the windows are real


def test_bf16_tower_stays_close_to_fp32_hf(hf_model: Any) -> None:
    """A bf16 tower (the serving dtype) runs end to end, within bf16 rounding of fp32 HF."""
    inputs = processor_inputs(TWO_IMAGES)
    encoder = load_vision_encoder(hf_model.config.to_dict(), hf_model.state_dict(),
                                  torch.bfloat16, CPU)
    got = encoder.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    for g, w in zip(got, hf_embeddings(hf_model, inputs), strict=True):
        assert g.dtype == torch.bfloat16
        assert (g.float() - w).abs().max() < 0.03 * w.abs().max()
