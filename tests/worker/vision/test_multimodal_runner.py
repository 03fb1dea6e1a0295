"""Prompts with images on the ModelRunner (tiny random checkpoints of both families, fp32):
greedy outputs equal HF generate and every logprob HF's, for one or two images, a prefill
chunk splitting an image's run, and requests with and without images sharing steps; the
tokenizer service's items and payloads run the same; a repeated image hits the encoder cache
and one inside a prefix-cache hit is not encoded; a missing payload rejects only its request;
older config and weight layouts load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file, save_file

from services.common import wire
from services.common.metrics import EncoderCacheMetrics
from services.common.packing import pack_uint8, unpack_int32, unpack_strings
from services.tokenizer.chat_images import image_tensors
from services.tokenizer.multimodal.content_hash import hash_image
from services.tokenizer.multimodal.image_decoder import DecodedImage
from services.tokenizer.multimodal.placeholders import expand_placeholders
from services.tokenizer.multimodal.registry import create_image_processing
from services.worker.models.config import ModelConfig
from services.worker.runner.config import RunnerConfig
from services.worker.runner.model_runner import ModelRunner
from tests.worker.driver import StepDriver
from tests.worker.vision.tiny_vlm_dirs import FAMILIES, save_tiny_vlm
from tests.worker.vision.tiny_vlms import noise_images
from tests.worker.vision.vlm_prompts import (
    MAX_NEW_TOKENS,
    Family,
    Prompt,
    assert_logprobs_match_hf,
    build_prompt,
    chat_text,
    hf_generate,
    load_family,
)

# (height, width) of the noise images: each gives a few image tokens in either family
# (Idefics3 also cuts them into tiles beside the global image).
SIZES = [(56, 84), (60, 40)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return load_family(request.param,
                       save_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param)))


def make_runner(family: Family, metrics: EncoderCacheMetrics | None = None) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=family.model_dir, device="cpu",
                                    max_model_len=256, kv_cache_memory=8 * 2**20,
                                    max_num_seqs=4),
                       encoder_cache_metrics=metrics)


def add(driver: StepDriver, prompt: Prompt) -> int:
    assert driver.runner.multimodal is not None
    for item in prompt.items:
        if driver.runner.multimodal.needs_payload(item):
            driver.runner.multimodal.add_payload(item.data_key, prompt.payloads[item.data_key])
    return driver.add(prompt.ids, max_new_tokens=MAX_NEW_TOKENS, mm_items=prompt.items,
                      sampling=wire.SamplingParams(logprobs=1, prompt_logprobs=1))


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_equals_hf(family: Family, num_images: int) -> None:
    prompt = build_prompt(family, noise_images(SIZES[:num_images]))
    driver = StepDriver(make_runner(family))
    handle = add(driver, prompt)
    assert driver.run()[handle] == hf_generate(family, prompt)
    assert_logprobs_match_hf(family, prompt, driver.requests[handle])


def test_chunk_splits_an_image_run(family: Family) -> None:
    prompt = build_prompt(family, noise_images(SIZES[:1]))
    item = prompt.items[0]
    # The first chunk ends in the middle of the image's run.
    budget = item.offset + item.length // 2
    driver = StepDriver(make_runner(family), token_budget=budget)
    handle = add(driver, prompt)
    out = driver.run_step()
    assert not unpack_int32(out.handles).size    # a prefill chunk: nothing sampled yet
    assert driver.requests[handle].num_computed == budget
    assert driver.run()[handle] == hf_generate(family, prompt)
    assert_logprobs_match_hf(family, prompt, driver.requests[handle])


def test_batch_mixing_images_and_text_gives_solo_outputs(family: Family) -> None:
    """Requests with other images and none share steps (prefill chunks beside decodes): each
    gets what HF generates for it alone (its own embeddings, its own M-RoPE delta)."""
    text_ids = family.tokenizer(chat_text(family, 0, "Tell me a story."))["input_ids"]
    text_only = Prompt(text_ids, [], {}, dict(input_ids=torch.tensor([text_ids]),
                                            attention_mask=torch.ones(1, len(text_ids))))
    prompts = [build_prompt(family, noise_images(SIZES[:1])), text_only,
               build_prompt(family, noise_images(SIZES[1:], seed=1), "And this one?")]
    driver = StepDriver(make_runner(family), token_budget=24)
    handles = [add(driver, prompt) for prompt in prompts]
    outputs = driver.run()
    for handle, prompt in zip(handles, prompts):
        assert outputs[handle] == hf_generate(family, prompt)
        assert_logprobs_match_hf(family, prompt, driver.requests[handle])


def test_repeated_image_hits_the_encoder_cache(family: Family) -> None:
    registry = CollectorRegistry()
    driver = StepDriver(make_runner(family, EncoderCacheMetrics(registry)))
    prompt = build_prompt(family, noise_images(SIZES[:1]))
    first = add(driver, prompt)
    driver.run()
    second = add(driver, prompt)
    outputs = driver.run()

    def value(name: str) -> float | None:
        return registry.get_sample_value(f"llm_mesh:encoder_cache_{name}_total")

    assert (value("queries"), value("hits")) == (2, 1)
    assert outputs[first] == outputs[second] == hf_generate(family, prompt)


def test_image_inside_a_prefix_cache_hit_is_not_encoded_again(family: Family) -> None:
    registry = CollectorRegistry()
    driver = StepDriver(make_runner(family, EncoderCacheMetrics(registry)))
    prompt = build_prompt(family, noise_images(SIZES[:1]),
                          "Say in many words what you see in the picture above, please.")
    first = add(driver, prompt)
    driver.run()
    item = prompt.items[0]
    num_blocks = -(-(item.offset + item.length) // driver.block_size)
    assert num_blocks * driver.block_size < len(prompt.ids)
    # No payload: the image's positions are all in the cached blocks.
    second = driver.add(prompt.ids, max_new_tokens=MAX_NEW_TOKENS, mm_items=prompt.items,
                        prefix_of=first, num_prefix_blocks=num_blocks)
    outputs = driver.run()
    assert registry.get_sample_value("llm_mesh:encoder_cache_queries_total") == 1
    assert outputs[second] == outputs[first] == hf_generate(family, prompt)


def test_missing_payload_rejects_only_its_request(family: Family) -> None:
    driver = StepDriver(make_runner(family))
    prompt = build_prompt(family, noise_images(SIZES[:1]))
    rejected = driver.add(prompt.ids, max_new_tokens=1, mm_items=prompt.items)  # no payload
    text_only = driver.add(prompt.ids[:5], max_new_tokens=1)
    out = driver.run_step()
    assert unpack_int32(out.rejected_handles).tolist() == [rejected]
    assert "missing" in unpack_strings(out.rejected_reasons)[0]
    assert text_only in unpack_int32(out.handles).tolist()


def test_older_qwen2_vl_config_reads_as_qwen2_with_mrope(tmp_path: Path) -> None:
    """Before transformers 5, Qwen2-VL configs keep the text keys at the top level and call
    the rope "mrope"."""
    hf = json.loads((save_tiny_vlm("qwen2_vl", tmp_path) / "config.json").read_text())
    text = hf.pop("text_config")
    section = text.pop("rope_parameters")["mrope_section"]
    hf.update(text, model_type="qwen2_vl", rope_theta=10000.0,
              rope_scaling={"type": "mrope", "mrope_section": section})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_hf_dir(tmp_path)
    assert (config.model_type, config.vision_model_type) == ("qwen2", "qwen2_vl")
    assert config.mrope_section == tuple(section) and config.rope_scaling is None
    assert config.attention_bias


def test_text_model_under_language_model_loads_the_same(tmp_path: Path) -> None:
    """Checkpoints saved since transformers 4.52 name the text model "model.language_model.*"
    and the tower "model.visual.*"."""
    family = load_family("qwen2_vl", save_tiny_vlm("qwen2_vl", tmp_path))
    prompt = build_prompt(family, noise_images(SIZES[:1]))
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({(f"model.language_model.{name.removeprefix('model.')}"
                if name.startswith("model.") else f"model.{name}"): t
               for name, t in tensors.items()}, tmp_path / "model.safetensors")
    driver = StepDriver(make_runner(family))
    handle = add(driver, prompt)
    assert driver.run()[handle] == hf_generate(family, prompt)
    assert_logprobs_match_hf(family, prompt, driver.requests[handle])


def test_tokenizer_items_and_payloads_run_on_the_worker(family: Family) -> None:
    """What the tokenizer service makes of two images (expanded ids, items, stored tensors)
    is what HF's processor makes, and runs on the worker as HF generates."""
    images = noise_images(SIZES)
    processing = create_image_processing(family.model_dir, family.tokenizer)
    assert processing is not None
    processed = [processing.process(DecodedImage(image, hash_image(image)), "image")
                 for image in images]
    ids, ranges = expand_placeholders(
        family.tokenizer(chat_text(family, len(images)))["input_ids"],
        processing.placeholder_token_id, [p.replacement_token_ids for p in processed],
        processing.image_token_id)
    reference = build_prompt(family, images)
    assert ids == reference.ids
    items = [wire.MultiModalItem(
        content_hash=p.content_hash, offset=r.offset, length=r.length,
        is_embed=b"" if r.is_embed is None else pack_uint8(r.is_embed),
        data_key=p.content_hash, num_embeds=p.num_image_tokens)
        for p, r in zip(processed, ranges)]
    prompt = Prompt(ids, items, {p.content_hash: image_tensors(p) for p in processed},
                    reference.hf_inputs)
    driver = StepDriver(make_runner(family))
    handle = add(driver, prompt)
    assert driver.run()[handle] == hf_generate(family, prompt)
    assert_logprobs_match_hf(family, prompt, driver.requests[handle])
