"""Which vision encoder runs an HF config's model_type, built from its checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from services.worker.models.config import UnsupportedModelError
from services.worker.models.vision.idefics3 import Idefics3EncoderConfig, Idefics3VisionEncoder
from services.worker.models.vision.qwen2_5_vl import Qwen2_5_VLVisionEncoder
from services.worker.models.vision.qwen2_vl import QwenVisionConfig, Qwen2VLVisionEncoder
from services.worker.models.vision.vision_weights import VisionWeights
from services.worker.models.weights import WeightSource

VisionEncoder = Qwen2VLVisionEncoder | Idefics3VisionEncoder
SUPPORTED_VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm")


def load_vision_encoder(config: dict[str, Any],
                        tensors: Mapping[str, torch.Tensor] | WeightSource,
                        dtype: torch.dtype, device: torch.device) -> VisionEncoder:
    """The encoder for a config.json (`config`) with its tensors from a checkpoint or a state
    dict. Its encode() takes the HF image processor's outputs: (pixel_values, image_grid_thw)
    for Qwen2-VL / Qwen2.5-VL, (pixel_values, pixel_attention_mask) for Idefics3 / SmolVLM."""
    model_type = config.get("model_type")
    weights = VisionWeights(tensors, dtype, device)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        vision = QwenVisionConfig.from_hf(model_type, config.get("vision_config") or {})
        cls = Qwen2_5_VLVisionEncoder if model_type == "qwen2_5_vl" else Qwen2VLVisionEncoder
        return cls(vision, weights)
    if model_type in ("idefics3", "smolvlm"):
        return Idefics3VisionEncoder(Idefics3EncoderConfig.from_hf(config), weights)
    raise UnsupportedModelError(f"no vision encoder for model_type {model_type!r} (supported: "
                                f"{', '.join(SUPPORTED_VISION_MODEL_TYPES)})")
