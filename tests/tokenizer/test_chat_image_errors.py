"""Image URLs a tokenizer fetches, and the ones it refuses: an allowed host or local path is
fetched (the same image as a data: URL gives the same prompt and item); a host
outside --allowed-media-domains, bytes that are no image and one image too many are each an
EncodeReply error naming the content part (a 400 at the gateway), with nothing fetched that
the limits forbid and no detokenizer state left behind; a text-only model refuses images,
and a prompt with the image token typed into its text is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_mesh.embedded import EmbeddedNats
from services.common import wire
from tests.tokenizer.multimodal.images import data_url, encode, image_part, noise_image
from tests.tokenizer.multimodal.media_server import MediaServer, media_server
from tests.tokenizer.serving_tokenizer import chat_request, serving_tokenizer, text_part
from tests.worker.vision.tiny_vlm_dirs import save_tiny_vlm

PNG = encode(noise_image(60, 40, seed=4))


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("vlm") / "qwen2_vl")


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        running.files["/cat.png"] = (PNG, True)
        running.files["/corrupt.png"] = (b"\x89PNG\r\n\x1a\n not really", True)
        yield running


async def test_an_image_on_an_allowed_host_or_path_is_fetched(
        nats_url: str, qwen_dir: Path, server: MediaServer, tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(PNG)
    async with serving_tokenizer(nats_url, qwen_dir, allowed_media_domains=["127.0.0.1"],
                                 allowed_local_media_path=str(tmp_path)) as tokenizer_service:
        replies = [await tokenizer_service.encode(chat_request(
            text_part("Look: "), image_part(url), request_id=f"chat-{i}"))
            for i, url in enumerate((server.url("/cat.png"), (tmp_path / "cat.png").as_uri(),
                                     data_url(PNG)))]
    fetched, read, sent = replies
    assert not fetched.error and not read.error, (fetched.error, read.error)
    assert server.requests == [("/cat.png", f"127.0.0.1:{server.port}")]
    # The same pixels, however they came: the same tokens, hash and stored tensors.
    assert fetched.token_ids == read.token_ids == sent.token_ids
    assert fetched.mm_items == read.mm_items == sent.mm_items


@pytest.mark.parametrize("case", ["host not allowed", "corrupt image", "too many images"])
async def test_a_refused_image_is_an_error_naming_its_part(
        nats_url: str, qwen_dir: Path, server: MediaServer, case: str) -> None:
    cat = image_part(server.url("/cat.png"))
    request, param, message = {
        "host not allowed": (
            chat_request(text_part("Look: "), image_part(server.url("/cat.png", "localhost"))),
            "messages[0].content[1].image_url.url", "not in the allowed media domains"),
        "corrupt image": (
            chat_request(image_part(server.url("/corrupt.png"))),
            "messages[0].content[0].image_url.url", "cannot decode the image"),
        "too many images": (
            chat_request(cat, text_part(" and "), cat),
            "messages[0].content[2]", "At most 1 image(s)"),
    }[case]
    async with serving_tokenizer(nats_url, qwen_dir, allowed_media_domains=["127.0.0.1"],
                                 limit_mm_per_prompt='{"image": 1}') as tokenizer_service:
        reply = await tokenizer_service.encode(request)
        assert tokenizer_service.service.states == {}
    assert message in reply.error
    assert reply.error_param == param
    assert not reply.token_ids and not reply.mm_items
    allowed = [("/corrupt.png", f"127.0.0.1:{server.port}")] if case == "corrupt image" else []
    assert server.requests == allowed


async def test_a_text_only_model_refuses_image_parts(nats_url: str,
                                                     server: MediaServer) -> None:
    async with serving_tokenizer(nats_url, "", allowed_media_domains=["127.0.0.1"]
                                 ) as tokenizer_service:
        reply = await tokenizer_service.encode(
            chat_request(text_part("Look: "), image_part(server.url("/cat.png"))))
        text_only = await tokenizer_service.encode(chat_request(text_part("Hello")))
        assert list(tokenizer_service.service.states) == ["chat-1"]   # the text-only one
    assert "does not accept images" in reply.error
    assert reply.error_param == "messages[0].content[1].image_url.url"
    assert server.requests == []
    assert not text_only.error and text_only.token_ids and not text_only.mm_items


async def test_the_image_token_typed_without_an_image_is_refused(nats_url: str,
                                                                 qwen_dir: Path) -> None:
    typed = "Look: <|vision_start|><|image_pad|><|vision_end|>"
    async with serving_tokenizer(nats_url, qwen_dir) as tokenizer_service:
        in_chat = await tokenizer_service.encode(chat_request(text_part(typed)))
        in_prompt = await tokenizer_service.encode(wire.EncodeRequest(prompt=typed))
        beside_an_image = await tokenizer_service.encode(
            chat_request(text_part(typed), image_part(data_url(PNG))))
        assert tokenizer_service.service.states == {}
    for reply in (in_chat, in_prompt):
        assert "image token but no image" in reply.error and not reply.token_ids
    assert "2 image placeholder(s) for 1 image(s)" in beside_an_image.error
