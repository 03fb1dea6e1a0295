"""Idefics3 / SmolVLM's vision side: the SigLIP tower (siglip.py) and the connector.

The processor cuts an image into square sub-images (tiles, plus the whole image downscaled)
of image_size pixels; each becomes (image_size / patch)^2 patch states, then the connector's
pixel shuffle folds every scale x scale block of patches into one row (scale^2 times wider)
and a linear (no bias) projects it to the text model's hidden size: each sub-image is
(image_size / patch / scale)^2 image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.worker.models.layers import Linear
from services.worker.models.vision.siglip import SiglipVisionConfig, SiglipVisionTransformer
from services.worker.models.vision.vision_weights import VisionWeights


@dataclass(frozen=True)
class Idefics3EncoderConfig:
    vision: SiglipVisionConfig
    scale_factor: int = 2

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Idefics3EncoderConfig:
        """From an idefics3 or smolvlm config.json."""
        return cls(SiglipVisionConfig.from_hf(config.get("vision_config") or {}),
                   config.get("scale_factor", 2))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, S, E] states of a square grid of patches -> [N, S / scale^2, E * scale^2]: token
    (i, j) holds patches (i * scale + a, j * scale + b), ordered by a then b (HF's order)."""
    n, s, e = x.shape
    side = int(s ** 0.5)
    blocks = x.view(n, side // scale, scale, side // scale, scale, e)
    return blocks.permute(0, 1, 3, 2, 4, 5).reshape(n, s // scale ** 2, e * scale ** 2)


class Idefics3VisionEncoder:
    def __init__(self, config: Idefics3EncoderConfig, weights: VisionWeights):
        self.config = config
        self.device = weights.device
        self.vision = SiglipVisionTransformer(config.vision, weights, "vision_model.")
        self.projection = Linear(weights.get("connector.modality_projection.proj.weight"))

    def encode(self, pixel_values: torch.Tensor,
               pixel_attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Embeddings [tokens_per_sub_image, text hidden] of each sub-image, for pixel_values
        [num_sub_images, C, H, W] and pixel_attention_mask [num_sub_images, H, W] (real pixels;
        None: all). Padding images of the processor's batch must be left out first
        (drop_padding_images)."""
        pixel_values = pixel_values.to(self.device)
        patch_mask = None
        if pixel_attention_mask is not None:
            p = self.config.vision.patch_size
            n, h, w = pixel_attention_mask.shape
            # NOTE: a patch is real if any of its pixels is (HF's unfold-and-sum).
            patch_mask = pixel_attention_mask.to(self.device, torch.bool).view(
                n, h // p, p, w // p, p).any(4).any(2)
        states = self.vision.forward(pixel_values, patch_mask)
        shuffled = pixel_shuffle(states, self.config.scale_factor)
        n, tokens, width = shuffled.shape
        return list(self.projection(shuffled.reshape(n * tokens, width)).view(n, tokens, -1))


def drop_padding_images(pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The processor's batch [B, max_images, C, H, W] (+ mask [B, max_images, H, W]) as its
    real sub-images [N, C, H, W] (+ [N, H, W]): HF drops the all-zero padding images."""
    flat = pixel_values.flatten(0, 1)
    real = (flat != 0).flatten(1).any(1)
    mask = None if pixel_attention_mask is None else pixel_attention_mask.flatten(0, 1)[real]
    return flat[real], mask
