"""The images' data plane: tensors stored under a content-addressed key in a JetStream object
store on a real nats-server come back bit for bit (several MiB: chunked, not one message);
a second put of the same key is a no-op; a missing key is a KeyError."""

from __future__ import annotations

import nats
import numpy as np
import pytest

from llm_mesh.embedded import EmbeddedNats
from services.common.mm_inputs import MultiModalInputs, mm_data_key
from services.common.subjects import Subjects


async def test_tensors_round_trip_through_the_object_store() -> None:
    with EmbeddedNats() as server:
        client = await nats.connect(server.url)
        try:
            store = await MultiModalInputs.open(client.jetstream(), Subjects("mm-test"))
            key = mm_data_key("ab" * 32, "qwen2_vl")
            assert key != mm_data_key("ab" * 32, "idefics3")
            pixels = np.random.default_rng(0).random((2000, 1176), dtype=np.float32)  # 9 MiB
            grid = np.array([[1, 40, 50]], dtype=np.int64)
            await store.put(key, {"pixel_values": pixels, "image_grid_thw": grid})
            await store.put(key, {"pixel_values": pixels[:1]})   # already there: kept
            got = await store.get(key)
            assert np.array_equal(got["pixel_values"], pixels)
            assert np.array_equal(got["image_grid_thw"], grid)
            with pytest.raises(KeyError, match="no preprocessed image"):
                await store.get("missing")
        finally:
            await client.close()
