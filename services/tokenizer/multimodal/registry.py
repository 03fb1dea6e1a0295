"""Which image processing a model gets, from its config.json's model_type."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from services.tokenizer.multimodal.idefics3 import Idefics3ImageProcessing
from services.tokenizer.multimodal.image_processing import ImageProcessing
from services.tokenizer.multimodal.qwen2_vl import Qwen2VLImageProcessing

MODEL_TYPE_TO_PROCESSING = {
    "qwen2_vl": Qwen2VLImageProcessing,
    "qwen2_5_vl": Qwen2VLImageProcessing,
    "idefics3": Idefics3ImageProcessing,
}


def create_image_processing(model_dir: Path,
                            tokenizer: PreTrainedTokenizerBase) -> ImageProcessing | None:
    """The model's image processing; None for a text-only model (its requests' image parts
    are refused by the caller)."""
    config = model_dir / "config.json"
    if not config.exists():
        return None
    model_type = json.loads(config.read_text()).get("model_type")
    processing = MODEL_TYPE_TO_PROCESSING.get(model_type)
    return processing.from_pretrained(model_dir, tokenizer) if processing else None
