"""Limits and allow-lists for media in requests, as settings fields (flags and env vars).

A service that takes images inherits this group (`class TokenizerSettings(..., MediaSettings)`).
The names follow vLLM's flags, so a vLLM user finds them where they expect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import setting

# NOTE: vLLM V1's default for every modality; the real bound is the model's context length.
DEFAULT_LIMIT_PER_PROMPT = 999


def parse_limit_mm_per_prompt(raw: str) -> dict[str, int]:
    """`{"image": 4}` (vLLM's --limit-mm-per-prompt) -> {"image": 4}; empty -> {}."""
    if not raw.strip():
        return {}
    try:
        limits = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"limit_mm_per_prompt is not JSON: {exc}") from exc
    if not isinstance(limits, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in limits.items()):
        raise ValueError('limit_mm_per_prompt must map modalities to counts >= 0, '
                         'e.g. {"image": 4}')
    return limits


@dataclass
class MediaSettings:
    limit_mm_per_prompt: str = setting(
        "", 'Most media items per prompt, by modality, as JSON (vLLM\'s flag), e.g. '
        f'{{"image": 4}}; a modality not named allows {DEFAULT_LIMIT_PER_PROMPT}')
    allowed_media_domains: list[str] = setting(
        [], "Hosts that image URLs may be fetched from (exact names, e.g. upload.example.com); "
        "none: no http(s) fetching at all (data: URLs always work). Redirects must stay on "
        "these hosts")
    allowed_local_media_path: str = setting(
        "", "A directory whose files requests may name as file:// image URLs (a security "
        "risk: only for trusted clients); empty: no file:// URLs")
    media_fetch_timeout_s: float = setting(
        5.0, "Longest time to fetch one image, redirects included (vLLM's "
        "VLLM_IMAGE_FETCH_TIMEOUT)")
    max_media_redirects: int = setting(5, "Most redirects followed when fetching one image")
    max_image_bytes: int = setting(
        20 * 1024 * 1024, "Largest encoded image accepted, in bytes (OpenAI's 20 MB)")
    max_image_pixels: int = setting(
        89_478_485, "Largest decoded image accepted, in pixels (width x height); the default "
        "is Pillow's own decompression-bomb threshold")

    def __post_init__(self) -> None:
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)    # a bad flag stops the start
        if self.allowed_local_media_path and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} "
                             "is not a directory")
        for name in ("media_fetch_timeout_s", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_media_redirects < 0:
            raise ValueError("max_media_redirects must be >= 0")

    def limit_for(self, modality: str) -> int:
        return parse_limit_mm_per_prompt(self.limit_mm_per_prompt).get(
            modality, DEFAULT_LIMIT_PER_PROMPT)
