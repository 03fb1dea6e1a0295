"""The worker service with a vision model on a real nats-server: a step's new requests get their
preprocessed images from the mm inputs store before the step runs; a request whose image is
not there is rejected with the reason while the rest of the step runs; /metrics counts the
encoder cache's queries and hits."""

from __future__ import annotations

import math
from pathlib import Path

from prometheus_client import generate_latest

from llm_mesh.embedded import EmbeddedNats
from services.common import wire, wire_pb
from services.common.bus import Bus
from services.common.mm_inputs import MultiModalInputs
from services.common.packing import pack_int32, unpack_int32, unpack_strings
from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings
from tests.worker.driver import as_pb, new_request_data
from tests.worker.vision.tiny_vlm_dirs import save_tiny_vlm
from tests.worker.vision.tiny_vlms import noise_images
from tests.worker.vision.vlm_prompts import build_prompt, load_family


def new_request(handle: int, ids: list[int], items: list[wire.MultiModalItem],
                first_block: int) -> wire_pb.NewRequestData:
    num_blocks = math.ceil(len(ids) / 16)
    new = new_request_data(handle, ids, list(range(first_block, first_block + num_blocks)))
    new.mm_items.extend(as_pb(item, wire_pb.MultiModalItem) for item in items)
    return new


async def test_step_fetches_images_and_rejects_a_missing_one(tmp_path: Path) -> None:
    family = load_family("qwen2_vl", save_tiny_vlm("qwen2_vl", tmp_path / "qwen2_vl"))
    prompt = build_prompt(family, noise_images([(56, 84)]))
    with EmbeddedNats() as server:
        settings = WorkerSettings(model=str(family.model_dir), nats_url=server.url,
                                  namespace="worker-images", device="cpu", max_model_len=256,
                                  kv_cache_memory=8 * 2**20, max_num_seqs=4)
        service = WorkerService(settings)
        service.bus = await Bus.for_settings(settings, name="worker-test")
        try:
            await service.setup()
            store = await MultiModalInputs.open(service.bus.client.jetstream(),
                                                service.subjects)
            key = prompt.items[0].data_key
            await store.put(key, prompt.payloads[key])
            missing = [wire.MultiModalItem().from_dict(prompt.items[0].to_dict())]
            missing[0].data_key = missing[0].content_hash = "gone"
            step = wire_pb.StepInput(
                step=0, new_requests=[new_request(1, prompt.ids, prompt.items, 1),
                                      new_request(2, prompt.ids, missing, 9)],
                num_scheduled_tokens=pack_int32([len(prompt.ids)] * 2))
            out = await service.on_step(step)
        finally:
            await service.close()
            await service.bus.close()
    assert not out.error
    assert sorted(unpack_int32(out.handles).tolist()) == [1, 2]
    assert unpack_int32(out.rejected_handles).tolist() == [2]
    assert "'gone' is missing" in unpack_strings(out.rejected_reasons)[0]
    metrics = generate_latest(service.registry).decode()
    assert "llm_mesh:encoder_cache_queries_total 2.0" in metrics
    assert "llm_mesh:encoder_cache_hits_total 0.0" in metrics
