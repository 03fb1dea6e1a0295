"""Idefics3 / SmolVLM preprocessing against HF's own Idefics3Processor (it builds without
torchvision): the same input ids, pixels and image spans for the same prompt and images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, Idefics3Processor, PreTrainedTokenizerBase
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)

from services.common.model_files import embedded_gguf_path
from services.tokenizer.multimodal import (
    DecodedImage, create_image_processing, decode_image, expand_placeholders,
)
from services.tokenizer.multimodal.idefics3 import (
    Idefics3ImageProcessing, Idefics3TokenIds, read_image_seq_len,
)
from tests.tokenizer.multimodal.images import encode, noise_image
from tests.tokenizer.multimodal.tiny_tokenizer import tiny_tokenizer

SPECIAL = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
           + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
PROMPT = "<|im_start|>User:<image>Describe<image>both.<end_of_utterance>\nAssistant:"
IMAGE_SEQ_LEN = 4
SIZES = [(130, 90), (200, 50)]           # (width, height): 2x2 tiles, then 1x2


def decoded(width: int, height: int, seed: int = 0) -> DecodedImage:
    return decode_image(encode(noise_image(width, height, seed)), 10**8, "p")


def small_image_processor(do_image_splitting: bool = True) -> Idefics3ImageProcessorPil:
    return Idefics3ImageProcessorPil(size={"longest_edge": 128},
                                     max_image_size={"longest_edge": 64},
                                     do_image_splitting=do_image_splitting)


def compare_with_hf(tokenizer: PreTrainedTokenizerBase,
                    image_processor: Idefics3ImageProcessorPil, seq_len: int) -> list[int]:
    """Asserts that our ids, pixels and spans equal HF's; returns each image's tile rows."""
    images = [decoded(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    hf = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                           image_seq_len=seq_len)
    theirs = hf(text=[PROMPT], images=[[image.image for image in images]],
                return_mm_token_type_ids=True)
    processing = Idefics3ImageProcessing(image_processor, Idefics3TokenIds.from_tokenizer(
        tokenizer), seq_len)
    ours = [processing.process(image, "p") for image in images]
    expanded, ranges = expand_placeholders(
        tokenizer(PROMPT)["input_ids"], processing.placeholder_token_id,
        [image.replacement_token_ids for image in ours], processing.image_token_id)

    assert expanded == theirs["input_ids"][0]
    np.testing.assert_array_equal(np.concatenate([p.pixel_values for p in ours]),
                                  theirs["pixel_values"][0])
    np.testing.assert_array_equal(np.concatenate([p.pixel_attention_mask for p in ours]),
                                  theirs["pixel_attention_mask"][0])
    in_image = np.zeros(len(expanded), dtype=int)
    for r, image in zip(ranges, ours):
        in_image[r.offset:r.offset + r.length] = 1
        assert r.is_embed is not None and sum(r.is_embed) == image.num_image_tokens
        assert [i for i, e in enumerate(r.is_embed) if e] == [
            i for i, t in enumerate(expanded[r.offset:r.offset + r.length])
            if t == processing.image_token_id]
    assert in_image.tolist() == theirs["mm_token_type_ids"][0]
    return [image.num_rows for image in ours]


@pytest.mark.parametrize("merges_double_newline", [True, False])
def test_split_images_match_hf(merges_double_newline: bool) -> None:
    tokenizer = tiny_tokenizer(SPECIAL, merges_double_newline=merges_double_newline)
    assert len(tokenizer.encode("\n\n")) == (1 if merges_double_newline else 2)
    assert compare_with_hf(tokenizer, small_image_processor(), IMAGE_SEQ_LEN) == [2, 1]


def test_images_not_split_match_hf() -> None:
    rows = compare_with_hf(tiny_tokenizer(SPECIAL), small_image_processor(False),
                           IMAGE_SEQ_LEN)
    assert rows == [0, 0]


@pytest.mark.slow
def test_with_the_embedded_smollm2_tokenizer() -> None:
    """SmolVLM's tokenizer is SmolLM2's plus these special tokens; real merges throughout."""
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_tokens(SPECIAL, special_tokens=True)
    assert compare_with_hf(tokenizer, small_image_processor(), 64) == [2, 1]


# As in HuggingFaceTB/SmolVLM-256M-Instruct's preprocessor_config.json and config.json.
SMOLVLM_PREPROCESSOR = {
    "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
    "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "max_image_size": {"longest_edge": 512}, "resample": 1,
    "rescale_factor": 1 / 255, "size": {"longest_edge": 2048},
    "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor"}
SMOLVLM_CONFIG = {"model_type": "idefics3", "scale_factor": 4,
                  "vision_config": {"image_size": 512, "patch_size": 16}}


def test_the_registry_builds_it_from_a_model_dir(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SMOLVLM_PREPROCESSOR))
    (tmp_path / "config.json").write_text(json.dumps(SMOLVLM_CONFIG))
    assert read_image_seq_len(tmp_path) == 64         # derived: (512 // 16) ** 2 / 4 ** 2
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 81}))
    assert read_image_seq_len(tmp_path) == 81         # the processor's own, when it has one
    processing = create_image_processing(tmp_path, tiny_tokenizer(SPECIAL))
    assert isinstance(processing, Idefics3ImageProcessing)
    image = decoded(130, 90)
    processed = processing.process(image, "p")
    theirs = Idefics3ImageProcessorPil(**SMOLVLM_PREPROCESSOR)(images=[image.image],
                                                               return_row_col_info=True)
    assert (processed.num_rows, processed.num_cols) == (theirs["rows"][0][0],
                                                        theirs["cols"][0][0]) == (3, 4)
    np.testing.assert_array_equal(processed.pixel_values, theirs["pixel_values"][0])
    assert processed.num_image_tokens == 81 * (3 * 4 + 1)


def test_a_tokenizer_without_the_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="<global-img>"):
        Idefics3TokenIds.from_tokenizer(tiny_tokenizer(["<fake_token_around_image>",
                                                        "<image>"]))
