"""Reading image_url content parts out of chat messages."""

from __future__ import annotations

from typing import Any

import pytest

from services.tokenizer.multimodal import ImageUrl, MediaError, MediaSettings, collect_image_urls


def test_image_parts_in_prompt_order_with_their_params() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "plain text"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png",
                                                "detail": "high"}}]}]
    assert collect_image_urls(messages, MediaSettings()) == [
        ImageUrl("data:image/png;base64,AA==", "auto", "messages[1].content[1].image_url.url"),
        ImageUrl("https://x.test/a.png", "high", "messages[2].content[0].image_url.url")]


@pytest.mark.parametrize("image_url, param", [
    ("https://x.test/a.png", "image_url"),              # a string, not an object
    ({"detail": "low"}, "image_url.url"),
    ({"url": ""}, "image_url.url"),
    ({"url": "https://x.test/a.png", "detail": "ultra"}, "image_url.detail")])
def test_malformed_parts_name_the_field(image_url: object, param: str) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": image_url}]}]
    with pytest.raises(MediaError) as caught:
        collect_image_urls(messages, MediaSettings())
    assert caught.value.param == f"messages[0].content[0].{param}"


def test_a_limit_of_zero_refuses_any_image() -> None:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]
    with pytest.raises(MediaError, match="At most 0 image"):
        collect_image_urls(messages, MediaSettings(limit_mm_per_prompt='{"image": 0}'))
