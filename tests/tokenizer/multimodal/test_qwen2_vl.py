"""Qwen2-VL preprocessing against HF: the image processor called directly, and the processor's
own placeholder rule (Qwen2VLProcessor itself cannot be built without torchvision)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from services.tokenizer.multimodal import (
    DecodedImage, MediaError, create_image_processing, decode_image, expand_placeholders,
)
from services.tokenizer.multimodal.qwen2_vl import Qwen2VLImageProcessing
from tests.tokenizer.multimodal.images import encode, noise_image
from tests.tokenizer.multimodal.tiny_tokenizer import tiny_tokenizer

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}Describe {IMAGE}please.<|im_end|>\n<|im_start|>assistant\n"
SIZES = [(130, 90), (40, 300), (20, 20)]      # (width, height): a grid each, one upscaled


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer(SPECIAL)


@pytest.fixture(scope="module")
def hf_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)


@pytest.fixture(scope="module")
def processing(hf_processor: Qwen2VLImageProcessorPil,
               tokenizer: PreTrainedTokenizerFast) -> Qwen2VLImageProcessing:
    return Qwen2VLImageProcessing(hf_processor, tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def decoded(width: int, height: int, seed: int = 0) -> DecodedImage:
    return decode_image(encode(noise_image(width, height, seed)), 10**8, "p")


def test_pixels_and_grids_match_the_hf_image_processor(
        processing: Qwen2VLImageProcessing, hf_processor: Qwen2VLImageProcessorPil) -> None:
    images = [decoded(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    ours = [processing.process(image, "p") for image in images]
    theirs = hf_processor(images=[image.image for image in images], return_tensors="np")
    np.testing.assert_array_equal(np.concatenate([p.pixel_values for p in ours]),
                                  theirs["pixel_values"])
    assert [p.image_grid_thw for p in ours] == [tuple(g) for g in theirs["image_grid_thw"]]
    assert len({p.image_grid_thw for p in ours}) == len(SIZES)
    for p in ours:
        assert p.num_image_tokens == np.prod(p.image_grid_thw) // hf_processor.merge_size ** 2
        assert p.content_hash


def hf_expanded_prompt(prompt: str, grids: list[tuple[int, int, int]],
                       hf_processor: Qwen2VLImageProcessorPil) -> str:
    """The prompt as HF's Qwen2VLProcessor writes it: its own replace_image_token, per image."""
    processor = SimpleNamespace(image_processor=hf_processor, image_token="<|image_pad|>")
    image_inputs = {"image_grid_thw": np.array(grids)}
    index = iter(range(len(grids)))
    return re.sub(re.escape("<|image_pad|>"), lambda _: Qwen2VLProcessor.replace_image_token(
        processor, image_inputs, next(index)), prompt)


def test_placeholder_expansion_matches_hf(processing: Qwen2VLImageProcessing,
                                          hf_processor: Qwen2VLImageProcessorPil,
                                          tokenizer: PreTrainedTokenizerFast) -> None:
    images = [processing.process(decoded(w, h, seed), "p")
              for seed, (w, h) in enumerate(SIZES[:2])]
    expected = tokenizer.encode(hf_expanded_prompt(
        PROMPT, [image.image_grid_thw for image in images], hf_processor))
    expanded, ranges = expand_placeholders(
        tokenizer.encode(PROMPT), processing.placeholder_token_id,
        [image.replacement_token_ids for image in images], processing.image_token_id)
    assert expanded == expected
    vision_start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    starts = [i + 1 for i, token_id in enumerate(expanded) if token_id == vision_start]
    assert [(r.offset, r.length, r.is_embed) for r in ranges] == [
        (start, image.num_image_tokens, None) for start, image in zip(starts, images)]


def test_an_image_the_model_cannot_take_is_a_media_error(
        processing: Qwen2VLImageProcessing) -> None:
    with pytest.raises(MediaError, match="aspect ratio") as caught:
        processing.process(decoded(2, 500), "messages[0].content[1].image_url.url")
    assert caught.value.param == "messages[0].content[1].image_url.url"


# As in Qwen/Qwen2-VL-2B-Instruct's preprocessor_config.json.
QWEN2_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_the_registry_builds_it_from_a_model_dir(tmp_path: Path, model_type: str,
                                                 tokenizer: PreTrainedTokenizerFast) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PREPROCESSOR))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    processing = create_image_processing(tmp_path, tokenizer)
    assert isinstance(processing, Qwen2VLImageProcessing)
    image = decoded(130, 90)
    hf_processor = Qwen2VLImageProcessorPil(**QWEN2_VL_PREPROCESSOR)
    processed = processing.process(image, "p")
    theirs = hf_processor(images=[image.image], return_tensors="np")
    np.testing.assert_array_equal(processed.pixel_values, theirs["pixel_values"])
    assert processed.image_grid_thw == (1, 6, 10)           # 84x140 after smart_resize


def test_a_text_model_gets_no_image_processing(tmp_path: Path,
                                               tokenizer: PreTrainedTokenizerFast) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert create_image_processing(tmp_path, tokenizer) is None
