"""The data plane of images (issue 19): a preprocessed image's tensors travel from the
tokenizer to the engine's worker through a JetStream object store (Subjects.mm_inputs_bucket),
chunked by JetStream, never as one large NATS message; messages carry only a
wire.MultiModalItem naming them by `data_key`.

The payload is safetensors bytes of numpy arrays (pixel_values, and the processor's extras:
image_grid_thw for Qwen2-VL, pixel_attention_mask for Idefics3), so no pickle crosses
services. Keys are content addressed (the image's hash and the processor's), so an image sent
twice is stored once; entries expire after MM_INPUTS_TTL_S.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable

import numpy as np
from nats.js import JetStreamContext
from nats.js import errors as js_errors
from nats.js.object_store import ObjectStore
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from services.common import wire, wire_pb
from services.common.block_hash import MultiModalSpan
from services.common.subjects import Subjects

MM_INPUTS_TTL_S = 3600.0   # long enough for a request to wait, be preempted and resume


def mm_data_key(content_hash: str, processor_id: str) -> str:
    """The object name of an image's tensors as one processor made them."""
    return f"{content_hash}.{hashlib.sha256(processor_id.encode()).hexdigest()[:16]}"


def mm_spans(items: Iterable[wire.MultiModalItem | wire_pb.MultiModalItem]
             ) -> tuple[MultiModalSpan, ...]:
    """The images' spans as block hashes take them."""
    return tuple(MultiModalSpan(i.offset, i.length, i.content_hash) for i in items)


def encode_mm_payload(tensors: dict[str, np.ndarray]) -> bytes:
    return save_safetensors({name: np.ascontiguousarray(a) for name, a in tensors.items()})


def decode_mm_payload(data: bytes) -> dict[str, np.ndarray]:
    return load_safetensors(data)


class MultiModalInputs:
    """The bucket of preprocessed images, created by whoever comes first."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects,
                   replicas: int = 1) -> MultiModalInputs:
        try:
            store = await js.object_store(subjects.mm_inputs_bucket)
        except js_errors.BucketNotFoundError:
            store = await js.create_object_store(subjects.mm_inputs_bucket, ttl=MM_INPUTS_TTL_S,
                                                 replicas=replicas)
        return cls(store)

    async def put(self, key: str, tensors: dict[str, np.ndarray]) -> None:
        """Stores an image's tensors unless they are there already."""
        try:
            await self._store.get_info(key)
            return
        except js_errors.ObjectNotFoundError:
            pass
        await self._store.put(key, encode_mm_payload(tensors))

    async def get(self, key: str) -> dict[str, np.ndarray]:
        """An image's tensors; KeyError when they are gone (expired, or never stored)."""
        buffer = io.BytesIO()
        try:
            await self._store.get(key, writeinto=buffer)
        except js_errors.ObjectNotFoundError:
            raise KeyError(f"no preprocessed image {key!r} in the mm inputs store") from None
        return decode_mm_payload(buffer.getvalue())
