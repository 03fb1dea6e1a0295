"""The image step of encoding a chat (issue 19): the `image_url` parts of its messages -> the
prompt's expanded token ids and one wire.MultiModalItem per image, each image's tensors
stored in the mm inputs object store, where the engine's worker reads them.

    collect_image_urls        every image part, refused past --limit-mm-per-prompt before
                              anything is fetched
    MediaConnector            all fetched at once (allow-lists, size and time limits), decoded
    ImageProcessing.process   the model's HF image processor, in threads (CPU work)
    the chat template         sees each image as {"type": "image"}: one placeholder each
    expand_placeholders       each placeholder -> the image's tokens; MultiModalInputs.put

Whatever is wrong with an image raises MediaError(message, param): a 400 naming the part.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from nats.js import JetStreamContext
from transformers import PreTrainedTokenizerBase

from services.common import wire
from services.common.mm_inputs import MultiModalInputs, mm_data_key
from services.common.packing import pack_uint8
from services.common.subjects import Subjects
from services.tokenizer.multimodal import (
    ImageProcessing,
    MediaConnector,
    MediaError,
    MediaSettings,
    ProcessedImage,
    collect_image_urls,
    create_image_processing,
    expand_placeholders,
)


@dataclass(frozen=True)
class _Vision:
    """What a model that takes images holds open."""
    processing: ImageProcessing
    connector: MediaConnector
    store: MultiModalInputs
    processor_id: str      # names the tensors' maker in their data keys


class ChatImages:
    """A model's image step; a text-only model's refuses every image part."""

    def __init__(self, settings: MediaSettings, model_name: str,
                 vision: _Vision | None = None) -> None:
        self._settings = settings
        self._model_name = model_name
        self._vision = vision

    @property
    def accepts_images(self) -> bool:
        return self._vision is not None

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: MediaSettings, model_name: str, model_dir: Path,
                   tokenizer: PreTrainedTokenizerBase, js: JetStreamContext, subjects: Subjects,
                   replicas: int = 1) -> AsyncIterator[ChatImages]:
        """The step for the model in `model_dir`, its HTTP client closed on exit."""
        processing = await asyncio.to_thread(create_image_processing, model_dir, tokenizer)
        if processing is None:
            yield cls(settings, model_name)
            return
        store = await MultiModalInputs.open(js, subjects, replicas)
        async with MediaConnector.open(settings) as connector:
            yield cls(settings, model_name, _Vision(processing, connector, store,
                                                    processor_id(model_dir, processing)))

    async def load(self, messages: Sequence[Mapping[str, Any]]) -> list[ProcessedImage]:
        """The images of `messages` (OpenAI content parts), fetched and processed, in order."""
        image_urls = collect_image_urls(messages, self._settings)
        if not image_urls:
            return []
        if self._vision is None:
            raise MediaError(f"model {self._model_name} does not accept images",
                             image_urls[0].param)
        processing = self._vision.processing
        decoded = await self._vision.connector.fetch_images(image_urls)
        return list(await asyncio.gather(*(
            asyncio.to_thread(processing.process, image, image_url.param)
            for image, image_url in zip(decoded, image_urls))))

    def refuse_image_tokens(self, token_ids: Sequence[int]) -> None:
        """A prompt without images must not hold the image token (typed into its text): the
        engine would find a run of image positions with no image for them."""
        if self._vision is not None and self._vision.processing.image_token_id in token_ids:
            raise MediaError("the prompt holds the model's image token but no image; send "
                             "images as image_url content parts")

    async def expand(self, token_ids: list[int], images: Sequence[ProcessedImage],
                     ) -> tuple[list[int], list[wire.MultiModalItem]]:
        """Expands each image's placeholder in the templated prompt and stores each image's
        tensors (once per data key); returns the prompt's ids and its images' items."""
        assert self._vision is not None
        vision = self._vision
        expanded, ranges = expand_placeholders(
            token_ids, vision.processing.placeholder_token_id,
            [image.replacement_token_ids for image in images], vision.processing.image_token_id)
        keys = [mm_data_key(image.content_hash, vision.processor_id) for image in images]
        to_store = dict(zip(keys, images))      # NOTE: an image sent twice is stored once
        await asyncio.gather(*(vision.store.put(key, image_tensors(image))
                               for key, image in to_store.items()))
        items = [wire.MultiModalItem(
            content_hash=image.content_hash, offset=span.offset, length=span.length,
            is_embed=b"" if span.is_embed is None else pack_uint8(span.is_embed),
            data_key=key, num_embeds=image.num_image_tokens)
            for image, span, key in zip(images, ranges, keys)]
        return expanded, items


def image_tensors(image: ProcessedImage) -> dict[str, np.ndarray]:
    """One image's tensors as the worker reads them: pixel_values, plus image_grid_thw [1, 3]
    (Qwen2-VL) or pixel_attention_mask [frames, H, W] (Idefics3)."""
    tensors = {"pixel_values": np.asarray(image.pixel_values, dtype=np.float32)}
    if image.image_grid_thw is not None:
        tensors["image_grid_thw"] = np.array([image.image_grid_thw], dtype=np.int64)
    if image.pixel_attention_mask is not None:
        tensors["pixel_attention_mask"] = image.pixel_attention_mask
    return tensors


def processor_id(model_dir: Path, processing: ImageProcessing) -> str:
    """The processing's family and its preprocessor settings: a new config makes new keys."""
    config = model_dir / "preprocessor_config.json"
    return f"{type(processing).__name__}\n{config.read_text() if config.exists() else ''}"


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: each image part as {"type": "image"} (the
    template writes the model's one placeholder for it); a content list without images as
    one string, which every template reads."""
    rendered = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            if any(part.get("type") == "image_url" for part in content):
                content = [{"type": "image"} if part.get("type") == "image_url" else part
                           for part in content]
            else:
                content = "".join(part.get("text") or "" for part in content)
        rendered.append({**message, "content": content})
    return rendered
