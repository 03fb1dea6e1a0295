"""Prompts with images for the worker's tests, built as HF's processors build them: the prompt
ids with each image's placeholders expanded, the images' mm items and payloads (what the
tokenizer sends), and HF's model inputs for the reference."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

from services.common import wire
from services.common.packing import pack_uint8
from tests.worker.driver import DriverRequest
from tests.worker.vision.tiny_vlm_dirs import IDEFICS3_IMAGE_SEQ_LEN

MAX_NEW_TOKENS = 8


@dataclass
class Prompt:
    ids: list[int]
    items: list[wire.MultiModalItem]
    payloads: dict[str, dict[str, np.ndarray]]   # data_key -> the image's tensors
    hf_inputs: dict[str, torch.Tensor]           # what HF's model takes


@dataclass
class Family:
    name: str
    model_dir: Path
    hf: Any
    tokenizer: Any
    image_processor: Any


def load_family(name: str, model_dir: Path) -> Family:
    """A saved tiny checkpoint (tiny_vlm_dirs.py) with HF's model, tokenizer and processor."""
    model_cls = (transformers.Qwen2VLForConditionalGeneration if name == "qwen2_vl"
                 else transformers.Idefics3ForConditionalGeneration)
    hf = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return Family(name, model_dir, hf, transformers.AutoTokenizer.from_pretrained(model_dir),
                  transformers.AutoImageProcessor.from_pretrained(model_dir))


def content_hash(image: Image.Image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


def chat_text(family: Family, num_images: int, question: str = "What is in the picture?"
              ) -> str:
    content = ([{"type": "image"}] * num_images
               + [{"type": "text", "text": question}])
    return family.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                tokenize=False, add_generation_prompt=True)


def build_prompt(family: Family, images: list[Image.Image],
                 question: str = "What is in the picture?") -> Prompt:
    """The prompt ids with each image's placeholders expanded as HF's processor does, the
    images' mm items and payloads (one image's processor outputs each), and HF's inputs."""
    text = chat_text(family, len(images), question)
    hashes = [content_hash(image) for image in images]
    payloads = {h: {k: v for k, v in family.image_processor(
        images=[image] if family.name == "qwen2_vl" else [[image]],
        return_tensors="np").items()} for h, image in zip(hashes, images)}
    if family.name == "qwen2_vl":
        ids, hf_inputs = qwen_inputs(family, text, images, [payloads[h] for h in hashes])
    else:
        processor = transformers.Idefics3Processor(family.image_processor, family.tokenizer,
                                                   image_seq_len=IDEFICS3_IMAGE_SEQ_LEN)
        hf_inputs = dict(processor(text=[text], images=[images], return_tensors="pt"))
        ids = hf_inputs["input_ids"][0].tolist()
        for payload in payloads.values():   # one image: no padding sub-images to drop
            payload["pixel_values"] = payload["pixel_values"][0]
            payload["pixel_attention_mask"] = payload["pixel_attention_mask"][0]
    image_token_id = family.hf.config.image_token_id
    items = image_runs(ids, image_token_id, hashes,
                       [image_embeds(family, payloads[h]) for h in hashes])
    return Prompt(ids, items, payloads, hf_inputs)


def qwen_inputs(family: Family, text: str, images: list[Image.Image],
                payloads: list[dict[str, np.ndarray]]) -> tuple[list[int], dict[str, Any]]:
    pad = family.hf.config.image_token_id
    ids: list[int] = []
    sizes = iter(int(p["image_grid_thw"].prod()) // 4 for p in payloads)
    for token in family.tokenizer(text)["input_ids"]:
        ids += [pad] * next(sizes) if token == pad else [token]
    # NOTE: transformers 5 finds the image tokens for M-RoPE by mm_token_type_ids (1: image).
    inputs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                  mm_token_type_ids=(torch.tensor([ids]) == pad).int(),
                  pixel_values=torch.from_numpy(np.concatenate([p["pixel_values"]
                                                                for p in payloads])),
                  image_grid_thw=torch.from_numpy(np.concatenate([p["image_grid_thw"]
                                                                  for p in payloads])))
    assert len(images) == len(payloads)
    return ids, inputs


def image_embeds(family: Family, payload: dict[str, np.ndarray]) -> int:
    if family.name == "qwen2_vl":
        return int(payload["image_grid_thw"].prod()) // 4
    return len(payload["pixel_values"]) * IDEFICS3_IMAGE_SEQ_LEN


def image_runs(ids: list[int], image_token_id: int, hashes: list[str],
               num_embeds: list[int]) -> list[wire.MultiModalItem]:
    """Each image's run: from its first image token to its last (Idefics3's runs hold row /
    column and separator tokens between, which is_embed leaves out)."""
    positions = np.flatnonzero(np.asarray(ids) == image_token_id)
    items, first = [], 0
    for h, n in zip(hashes, num_embeds):
        start, end = int(positions[first]), int(positions[first + n - 1]) + 1
        is_embed = np.asarray(ids[start:end]) == image_token_id
        items.append(wire.MultiModalItem(
            content_hash=h, offset=start, length=end - start,
            is_embed=b"" if is_embed.all() else pack_uint8(is_embed), data_key=h,
            num_embeds=n))
        first += n
    assert first == len(positions)
    return items


def hf_generate(family: Family, prompt: Prompt) -> list[int]:
    with torch.no_grad():
        out = family.hf.generate(**prompt.hf_inputs, max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False)
    return out[0, len(prompt.ids):].tolist()


def assert_logprobs_match_hf(family: Family, prompt: Prompt, req: DriverRequest) -> None:
    """Every prompt and output position's logprob equals HF's log_softmax over the same tokens
    and images (greedy outputs alone say little: a random model repeats itself)."""
    tokens = torch.tensor([req.token_ids])
    inputs = dict(prompt.hf_inputs, input_ids=tokens, attention_mask=torch.ones_like(tokens))
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = (tokens == family.hf.config.image_token_id).int()
    with torch.no_grad():
        ref = family.hf(**inputs).logits[0].log_softmax(-1)
    want = ref[torch.arange(tokens.shape[1] - 1), tokens[0, 1:]]
    got = torch.tensor([lp for _, lp in req.prompt_logprobs] + [lp for _, lp, *_ in req.logprobs])
    assert len(got) == len(want)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
