"""Images end to end, per model family (Qwen2-VL with M-RoPE; Idefics3, SmolVLM's
architecture): a mesh serving a tiny random-weight checkpoint built from the family's HF
config answers a chat with a base64 image, sent through the official openai client, with
HF transformers' greedy `generate` on the same image and text. The same request again hits
the prefix cache; the same image after other text re-uses the encoder's output (the worker's
encoder cache); another image never shares the blocks of an image. A URL outside the
allow-list (never fetched), a corrupt image and too many images are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.mesh import Mesh, metric_value, serving
from tests.tokenizer.multimodal.images import data_url, encode, noise_image
from tests.tokenizer.multimodal.media_server import MediaServer, media_server
from tests.worker.vision.tiny_vlm_dirs import FAMILIES, save_tiny_vlm
from tests.worker.vision.vlm_prompts import (MAX_NEW_TOKENS, Family, build_prompt,
                                             hf_generate, load_family)

pytestmark = pytest.mark.slow

QUESTION = "What is in the picture?"
BLOCK_SIZE = 16
MAX_IMAGES = 2


@pytest.fixture(scope="module")
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        running.files["/cat.png"] = (encode(noise_image(60, 44, seed=3)), True)
        yield running


@pytest.fixture(scope="module", params=FAMILIES)
def family_mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                server: MediaServer) -> Iterator[tuple[Family, Mesh, openai.OpenAI]]:
    name = request.param
    model_dir = save_tiny_vlm(name, tmp_path_factory.mktemp(name))
    model = ["--model", str(model_dir)]
    mesh = Mesh(tmp_path_factory.mktemp(f"mesh-{name}"), namespace=f"mm-{name}", extra_args={
        "tokenizer": [*model, "--allowed-media-domains", "127.0.0.1",
                      "--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES})],
        "scheduler": [*model, "--max-model-len", "512"],
        "worker": [*model, "--max-model-len", "512"]})
    with serving(mesh) as running, openai.OpenAI(base_url=f"{running.base_url}/v1",
                                                  api_key="unused", max_retries=0,
                                                  timeout=120) as client:
        yield load_family(name, model_dir), running, client


def _chat(client: openai.OpenAI, parts: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=MAX_NEW_TOKENS, temperature=0,
        messages=[{"role": "user", "content": parts}])


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _worker_metric(mesh: Mesh, name: str) -> float:
    return metric_value(mesh.services["worker"].get("/metrics")[1].decode(), name)


def test_an_image_chat_answers_as_hf_generate_and_caches(
        family_mesh: tuple[Family, Mesh, openai.OpenAI]) -> None:
    family, mesh, client = family_mesh
    image = noise_image(48, 40, seed=1)
    prompt = build_prompt(family, [image], QUESTION)
    want = family.tokenizer.decode(hf_generate(family, prompt), skip_special_tokens=True)
    parts = [_image_part(data_url(encode(image))), {"type": "text", "text": QUESTION}]

    first = _chat(client, parts)
    assert first.choices[0].message.content == want
    assert first.usage.prompt_tokens == len(prompt.ids)
    # The same request again: every full block of it is in the prefix cache, but for the
    # last prompt token's, which is computed again for its logits.
    again = _chat(client, parts)
    assert again.choices[0].message.content == want
    assert again.usage.prompt_tokens_details.cached_tokens == \
        (len(prompt.ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    # The same image after other text: no block is shared, the encoder's output is.
    hits = _worker_metric(mesh, "llm_mesh:encoder_cache_hits_total")
    moved = _chat(client, [{"type": "text", "text": "Look closely."}, *parts])
    assert moved.usage.prompt_tokens_details.cached_tokens == 0
    assert _worker_metric(mesh, "llm_mesh:encoder_cache_hits_total") == hits + 1


def test_another_image_shares_no_image_block(
        family_mesh: tuple[Family, Mesh, openai.OpenAI]) -> None:
    family, _, client = family_mesh
    one, other = noise_image(48, 40, seed=4), noise_image(48, 40, seed=5)
    first_image_token = build_prompt(family, [one], QUESTION).items[0].offset
    for image in (one, other):
        reply = _chat(client, [_image_part(data_url(encode(image))),
                               {"type": "text", "text": QUESTION}])
    # Only the blocks wholly before the image may be shared.
    assert reply.usage.prompt_tokens_details.cached_tokens <= \
        first_image_token // BLOCK_SIZE * BLOCK_SIZE


def test_an_allowed_url_is_fetched_and_bad_images_are_400(
        family_mesh: tuple[Family, Mesh, openai.OpenAI], server: MediaServer) -> None:
    _, _, client = family_mesh
    text = {"type": "text", "text": QUESTION}
    assert _chat(client, [_image_part(server.url("/cat.png")), text]).choices[0].message
    assert ("/cat.png", f"127.0.0.1:{server.port}") in server.requests
    fetched = len(server.requests)
    with pytest.raises(openai.BadRequestError, match="allowed media domains"):
        _chat(client, [_image_part(server.url("/cat.png", host="localhost")), text])
    assert len(server.requests) == fetched           # nothing fetched from a disallowed host
    with pytest.raises(openai.BadRequestError) as corrupt:
        _chat(client, [_image_part(data_url(b"not an image at all")), text])
    assert corrupt.value.body["param"].startswith("messages[0].content[0]")  # type: ignore[index]
    image = _image_part(data_url(encode(noise_image(48, 40, seed=6))))
    with pytest.raises(openai.BadRequestError, match=f"At most {MAX_IMAGES} image"):
        _chat(client, [image] * (MAX_IMAGES + 1) + [text])


def test_a_text_only_model_refuses_images(client: openai.OpenAI, model_name: str) -> None:
    """The embedded SmolLM2 (the session mesh) takes no images: a 400 that says so."""
    with pytest.raises(openai.BadRequestError, match="does not accept images"):
        client.chat.completions.create(model=model_name, max_tokens=4, messages=[
            {"role": "user", "content": [_image_part(data_url(encode(noise_image(8, 8)))),
                                         {"type": "text", "text": QUESTION}]}])
