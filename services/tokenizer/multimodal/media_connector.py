"""A request's image URLs -> decoded images: data:, http(s) and file:// URLs, each under the
server's limits (vLLM's MediaConnector)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import httpx2 as httpx

from services.tokenizer.multimodal.data_url import decode_data_url
from services.tokenizer.multimodal.errors import MediaError
from services.tokenizer.multimodal.http_fetcher import HttpFetcher
from services.tokenizer.multimodal.image_decoder import DecodedImage, decode_image
from services.tokenizer.multimodal.image_url import ImageUrl
from services.tokenizer.multimodal.local_media import read_local_media
from services.tokenizer.multimodal.media_settings import MediaSettings


class MediaConnector:
    def __init__(self, settings: MediaSettings, client: httpx.AsyncClient) -> None:
        self._settings = settings
        self._http = HttpFetcher(client, settings.allowed_media_domains,
                                 timeout_s=settings.media_fetch_timeout_s,
                                 max_bytes=settings.max_image_bytes,
                                 max_redirects=settings.max_media_redirects)

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: MediaSettings) -> AsyncIterator[MediaConnector]:
        """A connector with its own HTTP client, closed on exit."""
        async with httpx.AsyncClient() as client:
            yield cls(settings, client)

    async def fetch_bytes(self, url: str, param: str) -> bytes:
        scheme = url.partition(":")[0].lower()
        if scheme == "data":
            return decode_data_url(url, self._settings.max_image_bytes, param)
        if scheme in ("http", "https"):
            return await self._http.fetch(url, param)
        if scheme == "file":
            return await asyncio.to_thread(read_local_media, url,
                                           self._settings.allowed_local_media_path,
                                           self._settings.max_image_bytes, param)
        raise MediaError("image URL must be a data:, http(s): or file: URL", param)

    async def fetch_image(self, image_url: ImageUrl) -> DecodedImage:
        data = await self.fetch_bytes(image_url.url, image_url.param)
        return await asyncio.to_thread(decode_image, data, self._settings.max_image_pixels,
                                       image_url.param)

    async def fetch_images(self, image_urls: Sequence[ImageUrl]) -> list[DecodedImage]:
        """All of a prompt's images, fetched at once; the first failure cancels the rest and
        is raised as itself."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.fetch_image(url)) for url in image_urls]
        except ExceptionGroup as errors:
            media_errors, others = errors.split(MediaError)
            if media_errors is None or others is not None:
                raise   # NOTE: anything but bad media is a bug: keep all of it
            raise _first(media_errors) from None
        return [task.result() for task in tasks]


def _first(group: BaseExceptionGroup) -> BaseException:
    error = group.exceptions[0]
    return _first(error) if isinstance(error, BaseExceptionGroup) else error
