"""A chat with an image, encoded by the tokenizer service over a real nats-server: the prompt
comes back with the image's placeholder expanded exactly as HF's processor expands it, the
image's MultiModalItem says where its run is and which positions take embeddings, and the
tensors stored under its data key are the HF image processor's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import transformers
from PIL import Image

from llm_mesh.embedded import EmbeddedNats
from services.common import wire
from services.common.packing import unpack_int32, unpack_uint8
from tests.tokenizer.multimodal.images import data_url, encode, image_part, noise_image
from tests.tokenizer.serving_tokenizer import (
    chat_request,
    serving_tokenizer,
    template_view,
    text_part,
)
from tests.worker.vision.tiny_vlm_dirs import IDEFICS3_IMAGE_SEQ_LEN, save_tiny_vlm

PROMPT = "What is in this picture?"


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: save_tiny_vlm(family, root / family) for family in ("qwen2_vl", "idefics3")}


def hf_prompt_text(model_dir: Path) -> tuple[transformers.PreTrainedTokenizerBase, str]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    parts = (text_part(PROMPT), image_part("x"))
    return tokenizer, tokenizer.apply_chat_template(template_view(*parts), tokenize=False,
                                                    add_generation_prompt=True)


async def encode_one_image(nats_url: str, model_dir: Path, image: Image.Image,
                           ) -> tuple[wire.EncodeReply, dict[str, np.ndarray], int]:
    """The tokenizer's reply to PROMPT and `image` (a data: URL), the image's tensors as the
    worker will read them, and the prompt length its detokenizer state holds."""
    async with serving_tokenizer(nats_url, model_dir) as tokenizer_service:
        reply = await tokenizer_service.encode(
            chat_request(text_part(PROMPT), image_part(data_url(encode(image)))))
        assert not reply.error, reply.error
        stored = await tokenizer_service.store.get(reply.mm_items[0].data_key)
        return reply, stored, tokenizer_service.service.states["chat-1"].num_prompt_tokens


async def test_qwen2_vl_image_is_expanded_and_stored_as_hf_makes_it(
        nats_url: str, model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["qwen2_vl"]
    image = noise_image(90, 60, seed=1)
    reply, stored, num_prompt_tokens = await encode_one_image(nats_url, model_dir, image)
    [item] = reply.mm_items

    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    expected = processor(images=[image], return_tensors="np")
    num_pads = int(np.prod(expected["image_grid_thw"][0])) // processor.merge_size ** 2
    hf_tokenizer, text = hf_prompt_text(model_dir)
    # HF's Qwen2VLProcessor: the one pad of each image repeated, then tokenized as text.
    expected_ids = hf_tokenizer.encode(
        text.replace("<|image_pad|>", "<|image_pad|>" * num_pads), add_special_tokens=False)
    token_ids = unpack_int32(reply.token_ids).tolist()
    assert token_ids == expected_ids
    assert num_pads > 1

    start = token_ids.index(hf_tokenizer.convert_tokens_to_ids("<|vision_start|>")) + 1
    assert (item.offset, item.length, item.num_embeds) == (start, num_pads, num_pads)
    assert item.is_embed == b""      # every pad takes an embedding
    assert token_ids[start + num_pads] == hf_tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert sorted(stored) == ["image_grid_thw", "pixel_values"]
    assert stored["pixel_values"].dtype == np.float32
    assert np.array_equal(stored["pixel_values"], expected["pixel_values"])
    assert stored["image_grid_thw"].dtype == np.int64
    assert np.array_equal(stored["image_grid_thw"], expected["image_grid_thw"])
    assert num_prompt_tokens == len(token_ids)


async def test_idefics3_image_is_expanded_and_stored_as_hf_makes_it(
        nats_url: str, model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["idefics3"]
    image = noise_image(80, 50, seed=2)      # split into tiles, plus the global view
    reply, stored, _ = await encode_one_image(nats_url, model_dir, image)
    [item] = reply.mm_items

    hf_tokenizer, text = hf_prompt_text(model_dir)
    image_processor = transformers.Idefics3ImageProcessorPil.from_pretrained(model_dir)
    processor = transformers.Idefics3Processor(image_processor, hf_tokenizer,
                                               image_seq_len=IDEFICS3_IMAGE_SEQ_LEN)
    expected = processor(text=[text], images=[[image]], add_special_tokens=False,
                         return_tensors="np")
    expected_ids = expected["input_ids"][0].tolist()
    token_ids = unpack_int32(reply.token_ids).tolist()
    assert token_ids == expected_ids

    image_id = hf_tokenizer.convert_tokens_to_ids("<image>")
    fake_id = hf_tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    first, last = token_ids.index(fake_id), len(token_ids) - token_ids[::-1].index(fake_id)
    run = np.array(token_ids[first:last])
    assert (item.offset, item.length) == (first, last - first)
    assert np.array_equal(unpack_uint8(item.is_embed), run == image_id)
    assert item.num_embeds == int((run == image_id).sum())
    num_frames = item.num_embeds // IDEFICS3_IMAGE_SEQ_LEN
    assert num_frames > 1            # the test image is split

    assert sorted(stored) == ["pixel_attention_mask", "pixel_values"]
    assert stored["pixel_values"].dtype == np.float32
    assert stored["pixel_values"].shape[0] == num_frames
    assert np.array_equal(stored["pixel_values"], expected["pixel_values"][0][:num_frames])
    assert np.array_equal(stored["pixel_attention_mask"],
                          expected["pixel_attention_mask"][0][:num_frames])


async def test_the_same_image_twice_is_one_stored_object_and_two_runs(
        nats_url: str, model_dirs: dict[str, Path]) -> None:
    url = data_url(encode(noise_image(60, 60, seed=3)))
    async with serving_tokenizer(nats_url, model_dirs["qwen2_vl"]) as tokenizer_service:
        reply = await tokenizer_service.encode(
            chat_request(image_part(url), text_part(" and "), image_part(url)))
    assert not reply.error, reply.error
    first, second = reply.mm_items
    assert first.data_key == second.data_key and first.content_hash == second.content_hash
    assert second.offset > first.offset + first.length
    token_ids = unpack_int32(reply.token_ids)
    assert (token_ids[first.offset:first.offset + first.length]
            == token_ids[second.offset:second.offset + second.length]).all()
