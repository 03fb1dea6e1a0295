"""Qwen2-VL and Qwen2.5-VL: `<|image_pad|>` repeated once per merged patch.

The template writes `<|vision_start|><|image_pad|><|vision_end|>` per image; the one pad
becomes grid_t * grid_h * grid_w / merge_size**2 pads (HF's Qwen2VLProcessor, which needs
torchvision for its video half, so its rule is reproduced here).
"""

from __future__ import annotations

import math
from pathlib import Path

from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from services.tokenizer.multimodal.errors import MediaError
from services.tokenizer.multimodal.image_decoder import DecodedImage
from services.tokenizer.multimodal.image_processing import ProcessedImage
from services.tokenizer.multimodal.token_ids import single_token_id

IMAGE_TOKEN = "<|image_pad|>"


class Qwen2VLImageProcessing:
    def __init__(self, image_processor: Qwen2VLImageProcessorPil, image_token_id: int) -> None:
        self._processor = image_processor
        self.placeholder_token_id = image_token_id
        self.image_token_id = image_token_id

    @classmethod
    def from_pretrained(cls, model_dir: Path,
                        tokenizer: PreTrainedTokenizerBase) -> Qwen2VLImageProcessing:
        return cls(Qwen2VLImageProcessorPil.from_pretrained(model_dir),
                   single_token_id(tokenizer, IMAGE_TOKEN))

    def process(self, image: DecodedImage, param: str) -> ProcessedImage:
        try:
            out = self._processor(images=[image.image], return_tensors="np")
        except ValueError as exc:       # e.g. an aspect ratio over 200
            raise MediaError(f"the model cannot take this image: {exc}", param) from None
        t, h, w = (int(n) for n in out["image_grid_thw"][0])
        num_image_tokens = math.prod((t, h, w)) // self._processor.merge_size ** 2
        return ProcessedImage(
            content_hash=image.content_hash, pixel_values=out["pixel_values"],
            replacement_token_ids=(self.image_token_id,) * num_image_tokens,
            num_image_tokens=num_image_tokens, image_grid_thw=(t, h, w))
