"""What every model family's image processing gives the engine, and the interface it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.tokenizer.multimodal.image_decoder import DecodedImage


@dataclass(frozen=True)
class ProcessedImage:
    """One image, ready for the vision encoder, and the prompt tokens it takes."""
    content_hash: str
    pixel_values: np.ndarray
    # The tokens that replace the image's one placeholder token in the templated prompt.
    replacement_token_ids: tuple[int, ...]
    # How many of them take a vision embedding (the rest are markers: rows, columns, frames).
    num_image_tokens: int
    image_grid_thw: tuple[int, int, int] | None = None     # Qwen2-VL: patches in t, h, w
    pixel_attention_mask: np.ndarray | None = None         # Idefics3: real pixels per frame
    num_rows: int | None = None                            # Idefics3: tiles down (0: no split)
    num_cols: int | None = None                            # Idefics3: tiles across


class ImageProcessing(Protocol):
    """A model family's image preprocessing (the HF image processor) and prompt layout."""

    # The one token the chat template writes for each image.
    placeholder_token_id: int
    # The token at every position that takes an image embedding after expansion.
    image_token_id: int

    def process(self, image: DecodedImage, param: str) -> ProcessedImage:
        """CPU-bound (call it in a thread); MediaError for an image the model cannot take."""
        ...
