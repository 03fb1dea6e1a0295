"""Builds a SmolVLM-256M-shaped checkpoint to benchmark image requests with: the Idefics3
architecture, the embedded SmolLM2-135M as its text model (its real weights) and a SigLIP
vision tower of SmolVLM-256M's shape (12 layers, width 768, 512 px tiles of 16 px patches,
pixel shuffle by 4: 64 image tokens a tile) with seeded random weights — no vision weights
can be downloaded here, and the encoder's cost depends on its shape, not its values.

    python -m benchmarks.make_smolvlm /tmp/smolvlm
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from services.common.model_files import resolve_model
from tests.worker.vision.tiny_vlm_dirs import IDEFICS3_SPECIAL_TOKENS, chat_template

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, image_size=512, patch_size=16)
SCALE_FACTOR = 4


def build(out_dir: Path, seed: int = 0) -> None:
    text_dir = resolve_model("").hf_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_tokens(IDEFICS3_SPECIAL_TOKENS, special_tokens=True)
    tokenizer.chat_template = chat_template("idefics3")
    text_model = transformers.AutoModelForCausalLM.from_pretrained(text_dir,
                                                                   dtype=torch.float32)
    text_model.resize_token_embeddings(len(tokenizer))
    text_config = text_model.config.to_dict()
    config = transformers.Idefics3Config(
        text_config=text_config, vision_config=VISION, scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    model.model.text_model.load_state_dict(text_model.model.state_dict())
    model.tie_weights()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": VISION["image_size"]},
        max_image_size={"longest_edge": VISION["image_size"]}).save_pretrained(out_dir)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    build(args.out_dir)
    print(args.out_dir)


if __name__ == "__main__":
    main()
