"""Idefics3 and SmolVLM: an image becomes tiles plus a global view, each framed by markers.

HF's Idefics3Processor writes, for an image split into R rows and C columns of tiles:

    for each row r, for each column c:  <fake_token_around_image><row_r_col_c><image>*L
    and after each row:                 "\n"
    then the downscaled global view:    "\n"<fake_token_around_image><global-img><image>*L
                                        <fake_token_around_image>

and for an image not split (R = C = 0) only the global view, without the newline. L is
image_seq_len (patches per tile after pixel shuffle). Every piece of text sits between two
special tokens, so it tokenizes alone: the last row's "\n" and the global view's "\n" are one
"\n\n" (one token where the tokenizer merges it). This module builds those ids directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)

from services.tokenizer.multimodal.errors import MediaError
from services.tokenizer.multimodal.image_decoder import DecodedImage
from services.tokenizer.multimodal.image_processing import ProcessedImage
from services.tokenizer.multimodal.token_ids import single_token_id, text_token_ids

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
MAX_TILES_PER_SIDE = 6        # the <row_i_col_j> tokens the tokenizer has


@dataclass(frozen=True)
class Idefics3TokenIds:
    image: int
    fake_image: int
    global_image: int
    row_col: tuple[tuple[int, ...], ...]      # [row][col], both from 0
    newline: tuple[int, ...]
    double_newline: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> Idefics3TokenIds:
        return cls(
            image=single_token_id(tokenizer, IMAGE_TOKEN),
            fake_image=single_token_id(tokenizer, FAKE_IMAGE_TOKEN),
            global_image=single_token_id(tokenizer, GLOBAL_IMAGE_TOKEN),
            row_col=tuple(tuple(single_token_id(tokenizer, f"<row_{r + 1}_col_{c + 1}>")
                                for c in range(MAX_TILES_PER_SIDE))
                          for r in range(MAX_TILES_PER_SIDE)),
            newline=text_token_ids(tokenizer, "\n"),
            double_newline=text_token_ids(tokenizer, "\n\n"))


def idefics3_replacement(ids: Idefics3TokenIds, num_rows: int, num_cols: int,
                         image_seq_len: int) -> list[int]:
    """The token ids HF's Idefics3Processor puts in place of one `<image>`."""
    tile = [ids.image] * image_seq_len
    replacement: list[int] = []
    for r in range(num_rows):
        for c in range(num_cols):
            replacement += [ids.fake_image, ids.row_col[r][c], *tile]
        replacement += ids.newline if r < num_rows - 1 else ids.double_newline
    return replacement + [ids.fake_image, ids.global_image, *tile, ids.fake_image]


class Idefics3ImageProcessing:
    def __init__(self, image_processor: Idefics3ImageProcessorPil, token_ids: Idefics3TokenIds,
                 image_seq_len: int) -> None:
        self._processor = image_processor
        self._ids = token_ids
        self._image_seq_len = image_seq_len
        self.placeholder_token_id = token_ids.image
        self.image_token_id = token_ids.image

    @classmethod
    def from_pretrained(cls, model_dir: Path,
                        tokenizer: PreTrainedTokenizerBase) -> Idefics3ImageProcessing:
        return cls(Idefics3ImageProcessorPil.from_pretrained(model_dir),
                   Idefics3TokenIds.from_tokenizer(tokenizer), read_image_seq_len(model_dir))

    def process(self, image: DecodedImage, param: str) -> ProcessedImage:
        try:
            out = self._processor(images=[image.image], return_row_col_info=True,
                                  return_tensors="np")
        except ValueError as exc:
            raise MediaError(f"the model cannot take this image: {exc}", param) from None
        num_rows, num_cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        if max(num_rows, num_cols) > MAX_TILES_PER_SIDE:
            raise MediaError(f"the image splits into {num_rows}x{num_cols} tiles, more than "
                             f"the model's {MAX_TILES_PER_SIDE}x{MAX_TILES_PER_SIDE}", param)
        num_frames = num_rows * num_cols + 1
        return ProcessedImage(
            content_hash=image.content_hash,
            pixel_values=out["pixel_values"][0][:num_frames],
            replacement_token_ids=tuple(idefics3_replacement(self._ids, num_rows, num_cols,
                                                             self._image_seq_len)),
            num_image_tokens=self._image_seq_len * num_frames,
            pixel_attention_mask=out["pixel_attention_mask"][0][:num_frames],
            num_rows=num_rows, num_cols=num_cols)


def read_image_seq_len(model_dir: Path) -> int:
    """The processor's `image_seq_len`, else derived as HF documents it:
    (image_size // patch_size) ** 2 / scale_factor ** 2."""
    processor_config = model_dir / "processor_config.json"
    if processor_config.exists():
        configured = json.loads(processor_config.read_text()).get("image_seq_len")
        if configured is not None:
            return int(configured)
    config = json.loads((model_dir / "config.json").read_text())
    vision = config.get("vision_config", {})
    patches_per_side = vision.get("image_size", 224) // vision.get("patch_size", 32)
    return int(patches_per_side ** 2 / config.get("scale_factor", 2) ** 2)
