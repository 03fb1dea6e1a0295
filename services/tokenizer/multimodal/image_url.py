"""The `image_url` content parts of OpenAI chat messages, in prompt order.

    {"type": "image_url", "image_url": {"url": "https://... | data:image/png;base64,...",
                                        "detail": "auto" | "low" | "high"}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.tokenizer.multimodal.errors import MediaError
from services.tokenizer.multimodal.media_settings import MediaSettings

DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class ImageUrl:
    url: str
    detail: str           # kept for the API's sake: neither Qwen2-VL nor Idefics3 uses it
    param: str            # where the part sits in the request, for the error's `param`


def parse_image_part(part: Mapping[str, Any], param: str) -> ImageUrl:
    """One `{"type": "image_url", ...}` part -> ImageUrl."""
    image_url = part.get("image_url")
    if not isinstance(image_url, Mapping):
        raise MediaError("image_url must be an object with a url", f"{param}.image_url")
    url = image_url.get("url")
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string", f"{param}.image_url.url")
    detail = image_url.get("detail") or "auto"
    if detail not in DETAILS:
        raise MediaError(f"image_url.detail must be one of {', '.join(DETAILS)}",
                         f"{param}.image_url.detail")
    return ImageUrl(url=url, detail=detail, param=f"{param}.image_url.url")


def collect_image_urls(messages: Sequence[Mapping[str, Any]],
                       settings: MediaSettings) -> list[ImageUrl]:
    """Every image part of `messages` in order, refused past the per-prompt limit (before
    anything is fetched, so an over-limit request costs nothing)."""
    limit = settings.limit_for("image")
    images: list[ImageUrl] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, Sequence) or isinstance(content, str):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            if len(images) == limit:
                # NOTE: vLLM's wording.
                raise MediaError(f"At most {limit} image(s) may be provided in one prompt.",
                                 f"messages[{i}].content[{j}]")
            images.append(parse_image_part(part, f"messages[{i}].content[{j}]"))
    return images
