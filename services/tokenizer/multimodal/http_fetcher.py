"""http(s) image URLs, fetched only from allowed hosts, with a size cap and a deadline.

Redirects are followed here, one hop at a time, so every hop's host is checked against the
allow-list before it is contacted: a redirect cannot lead the server anywhere a client could
not send it directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx2 as httpx

from services.tokenizer.multimodal.errors import MediaError


class HttpFetcher:
    def __init__(self, client: httpx.AsyncClient, allowed_domains: Iterable[str], *,
                 timeout_s: float, max_bytes: int, max_redirects: int) -> None:
        self._client = client
        self._allowed_hosts = frozenset(_normalize_host(host) for host in allowed_domains)
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._max_redirects = max_redirects

    async def fetch(self, url: str, param: str) -> bytes:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._follow(url, param)
        except TimeoutError:
            raise MediaError(f"fetching the image took longer than {self._timeout_s} s",
                             param) from None
        except httpx.HTTPError as exc:
            raise MediaError(f"cannot fetch the image: {type(exc).__name__}", param) from None

    async def _follow(self, url: str, param: str) -> bytes:
        target = self._allowed_url(url, param)
        for _ in range(self._max_redirects + 1):
            async with self._client.stream("GET", target, follow_redirects=False) as response:
                if response.is_redirect:
                    target = self._allowed_url(
                        str(response.url.join(response.headers["location"])), param)
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching the image answered HTTP {response.status_code}",
                                     param)
                return await self._read(response, param)
        raise MediaError(f"fetching the image took more than {self._max_redirects} redirects",
                         param)

    def _allowed_url(self, url: str, param: str) -> httpx.URL:
        # NOTE: the URL is parsed once, by the client that will connect: the host checked is
        # the host contacted (no second parser to disagree with).
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            raise MediaError("image URL is not a valid URL", param) from None
        if parsed.scheme not in ("http", "https"):
            raise MediaError(f"image URL scheme {parsed.scheme!r} is not allowed here", param)
        if not self._allowed_hosts:
            raise MediaError("fetching images by URL is not enabled on this server; send a "
                             "data: URL", param)
        if _normalize_host(parsed.host) not in self._allowed_hosts:
            raise MediaError(f"image host {parsed.host!r} is not in the allowed media "
                             "domains", param)
        return parsed

    async def _read(self, response: httpx.Response, param: str) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_bytes:
            raise MediaError(f"image is larger than {self._max_bytes} bytes", param)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self._max_bytes:
                raise MediaError(f"image is larger than {self._max_bytes} bytes", param)
            chunks.append(chunk)
        return b"".join(chunks)


def _normalize_host(host: str) -> str:
    return host.lower().rstrip(".")
