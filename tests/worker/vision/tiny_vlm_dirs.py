"""Tiny random vision-language checkpoints saved as HF directories every service can load.

`save_tiny_vlm(family, directory)` writes config.json + model.safetensors (random weights,
seeded), the embedded SmolLM2 tokenizer with the family's image tokens added, a chat template
that renders OpenAI-style content lists (`{"type": "image"}` -> the family's placeholder) and
the image processor's preprocessor_config.json, with small image sizes so tests stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from services.common.model_files import resolve_model
from tests.worker.vision.tiny_vlms import MROPE_SECTION, TEXT, build

FAMILIES = ("qwen2_vl", "idefics3")
QWEN_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IDEFICS3_SPECIAL_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                            "<global-img>"]
                           + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
IDEFICS3_IMAGE_PLACEHOLDER = "<image>"
# Idefics3: 32 px tiles of 8 px patches, scale factor 2 -> 4 image tokens a tile; images are
# resized to a longest edge of 64 px, so a 2 x 2 grid of tiles plus the global image at most.
IDEFICS3_TILE = 32
IDEFICS3_IMAGE_SEQ_LEN = (IDEFICS3_TILE // 8) ** 2 // 4
# Qwen2-VL: between 2 x 2 and 4 x 4 merged tokens (28 px each) an image.
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 112 * 112

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '@PLACEHOLDER@' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_template(family: str) -> str:
    placeholder = (QWEN_IMAGE_PLACEHOLDER if family == "qwen2_vl"
                   else IDEFICS3_IMAGE_PLACEHOLDER)
    return _CHAT_TEMPLATE.replace("@PLACEHOLDER@", placeholder)


def save_tiny_vlm(family: str, directory: Path) -> Path:
    """Saves a tiny random `family` ("qwen2_vl" or "idefics3") checkpoint with its tokenizer,
    chat template and image processor to `directory`; returns `directory`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    directory = Path(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("").hf_dir)
    special = QWEN_SPECIAL_TOKENS if family == "qwen2_vl" else IDEFICS3_SPECIAL_TOKENS
    tokenizer.add_tokens(special, special_tokens=True)
    tokenizer.chat_template = chat_template(family)
    text = dict(TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=True)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           _TOKEN_ID_FIELDS[family].items()}
    config = (_qwen2_vl_config(text, ids) if family == "qwen2_vl"
              else _idefics3_config(text, ids))
    model_cls = (transformers.Qwen2VLForConditionalGeneration if family == "qwen2_vl"
                 else transformers.Idefics3ForConditionalGeneration)
    build(model_cls, config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_processor(family).save_pretrained(directory)
    return directory


_TOKEN_ID_FIELDS = {
    "qwen2_vl": dict(image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                     vision_start_token_id="<|vision_start|>",
                     vision_end_token_id="<|vision_end|>"),
    "idefics3": dict(image_token_id="<image>"),
}


def image_processor(family: str) -> Any:
    """The family's HF image processor (PIL), sized small."""
    if family == "qwen2_vl":
        return transformers.Qwen2VLImageProcessorPil(min_pixels=QWEN_MIN_PIXELS,
                                                     max_pixels=QWEN_MAX_PIXELS)
    return transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IDEFICS3_TILE},
        max_image_size={"longest_edge": IDEFICS3_TILE})


def _qwen2_vl_config(text: dict[str, Any], ids: dict[str, int]) -> transformers.Qwen2VLConfig:
    text = dict(text, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                           mrope_section=MROPE_SECTION))
    vision = dict(depth=2, embed_dim=32, hidden_size=TEXT["hidden_size"], num_heads=4,
                  mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                      tie_word_embeddings=True, **ids)


def _idefics3_config(text: dict[str, Any], ids: dict[str, int]) -> transformers.Idefics3Config:
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, image_size=IDEFICS3_TILE, patch_size=8)
    return transformers.Idefics3Config(text_config=dict(model_type="llama", **text),
                                       vision_config=vision, scale_factor=2,
                                       pad_token_id=text["pad_token_id"],
                                       tie_word_embeddings=True, **ids)
