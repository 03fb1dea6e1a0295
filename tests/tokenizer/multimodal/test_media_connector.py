"""Fetching images: the allow-list (hosts, redirects, local paths), the limits, and errors that
all come out as MediaError with the offending part's param."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from services.common.settings import build_settings, parse_settings
from services.tokenizer.multimodal import (
    ImageUrl, MediaConnector, MediaError, MediaSettings, collect_image_urls,
)
from tests.tokenizer.multimodal.images import data_url, encode, image_part, noise_image
from tests.tokenizer.multimodal.media_server import MediaServer, media_server

PARAM = "messages[0].content[0].image_url.url"
PNG = encode(noise_image(32, 24))


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        running.files["/cat.png"] = (PNG, True)
        running.files["/cat-chunked.png"] = (PNG, False)
        running.files["/corrupt.png"] = (PNG[:40] + b"\x00" * 200, True)
        yield running


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as client:     # no proxy from the env
        yield client


def connector(http: httpx.AsyncClient, **overrides: object) -> MediaConnector:
    settings = MediaSettings(**{"allowed_media_domains": ["127.0.0.1"], **overrides})
    return MediaConnector(settings, http)


async def refused(connector: MediaConnector, url: str, match: str) -> MediaError:
    with pytest.raises(MediaError, match=match) as caught:
        await connector.fetch_image(ImageUrl(url, "auto", PARAM))
    assert caught.value.param == PARAM
    return caught.value


async def test_an_allowed_host_is_fetched(server: MediaServer, http: httpx.AsyncClient) -> None:
    image = await connector(http).fetch_image(ImageUrl(server.url("/cat.png"), "auto", PARAM))
    assert image.image.size == (32, 24)
    assert [path for path, _ in server.requests] == ["/cat.png"]


async def test_a_host_not_listed_is_never_contacted(server: MediaServer,
                                                    http: httpx.AsyncClient) -> None:
    # NOTE: "localhost" reaches the same server: only the allow-list keeps the request away.
    await refused(connector(http), server.url("/cat.png", host="localhost"),
                  "not in the allowed media domains")
    assert server.requests == []


async def test_no_allowed_domains_means_no_http_at_all(server: MediaServer,
                                                       http: httpx.AsyncClient) -> None:
    await refused(connector(http, allowed_media_domains=[]), server.url("/cat.png"),
                  "not enabled")
    assert server.requests == []


async def test_a_redirect_to_a_host_not_listed_is_refused(server: MediaServer,
                                                          http: httpx.AsyncClient) -> None:
    target = server.url("/cat.png", host="localhost")
    await refused(connector(http), server.url(f"/redirect?to={target}"),
                  "not in the allowed media domains")
    assert [path for path, _ in server.requests] == [f"/redirect?to={target}"]


async def test_a_redirect_within_the_allow_list_is_followed(server: MediaServer,
                                                            http: httpx.AsyncClient) -> None:
    url = server.url("/redirect?to=/cat.png")
    image = await connector(http).fetch_image(ImageUrl(url, "auto", PARAM))
    assert image.image.size == (32, 24)
    assert [path for path, _ in server.requests] == ["/redirect?to=/cat.png", "/cat.png"]


async def test_redirects_are_counted(server: MediaServer, http: httpx.AsyncClient) -> None:
    await refused(connector(http, max_media_redirects=0),
                  server.url("/redirect?to=/cat.png"), "more than 0 redirects")
    assert len(server.requests) == 1


@pytest.mark.parametrize("path", ["/cat.png", "/cat-chunked.png"])
async def test_an_image_over_the_byte_limit_is_refused(server: MediaServer,
                                                       http: httpx.AsyncClient,
                                                       path: str) -> None:
    await refused(connector(http, max_image_bytes=len(PNG) - 1), server.url(path),
                  f"larger than {len(PNG) - 1} bytes")


async def test_an_image_over_the_pixel_limit_is_refused(server: MediaServer,
                                                        http: httpx.AsyncClient) -> None:
    await refused(connector(http, max_image_pixels=32 * 24 - 1), server.url("/cat.png"),
                  "32x24, more than")


async def test_corrupt_bytes_are_refused(server: MediaServer, http: httpx.AsyncClient) -> None:
    await refused(connector(http), server.url("/corrupt.png"), "cannot decode")
    await refused(connector(http), data_url(b"not an image at all"), "cannot decode")


async def test_http_errors_and_timeouts_are_refused(server: MediaServer,
                                                    http: httpx.AsyncClient) -> None:
    await refused(connector(http), server.url("/missing.png"), "HTTP 404")
    await refused(connector(http, media_fetch_timeout_s=0.2), server.url("/stall"),
                  "longer than 0.2 s")


async def test_data_url_and_http_give_the_same_hash(server: MediaServer,
                                                    http: httpx.AsyncClient) -> None:
    media = connector(http)
    by_http, by_data = await media.fetch_images([ImageUrl(server.url("/cat.png"), "auto", PARAM),
                                                 ImageUrl(data_url(PNG), "auto", PARAM)])
    assert by_http.content_hash == by_data.content_hash


async def test_one_bad_image_fails_the_prompt_with_its_own_param(
        server: MediaServer, http: httpx.AsyncClient) -> None:
    urls = [ImageUrl(data_url(PNG), "auto", "messages[0].content[0].image_url.url"),
            ImageUrl(data_url(b"junk"), "auto", "messages[0].content[1].image_url.url")]
    with pytest.raises(MediaError) as caught:
        await connector(http).fetch_images(urls)
    assert caught.value.param == "messages[0].content[1].image_url.url"


async def test_too_many_images_are_refused_before_any_fetch(server: MediaServer,
                                                            http: httpx.AsyncClient) -> None:
    settings = MediaSettings(limit_mm_per_prompt='{"image": 2}',
                             allowed_media_domains=["127.0.0.1"])
    messages = [{"role": "user", "content": [image_part(server.url("/cat.png"))] * 2},
                {"role": "user", "content": [{"type": "text", "text": "and"},
                                             image_part(server.url("/cat.png"))]}]
    with pytest.raises(MediaError, match="At most 2 image") as caught:
        collect_image_urls(messages, settings)
    assert caught.value.param == "messages[1].content[1]"
    assert server.requests == []
    assert len(collect_image_urls(messages[:1], settings)) == 2


async def test_data_urls_must_be_base64_images() -> None:
    async with MediaConnector.open(MediaSettings()) as media:
        for url, match in [("data:text/plain;base64,aGk=", "not an image"),
                           ("data:image/png,rawbytes", "must be base64"),
                           ("data:image/png;base64,@@@@", "not valid base64"),
                           ("ftp://example.com/cat.png", "must be a data:")]:
            await refused(media, url, match)


async def test_file_urls_only_under_the_allowed_path(tmp_path: Path,
                                                     http: httpx.AsyncClient) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    media = connector(http, allowed_local_media_path=str(allowed))
    image = await media.fetch_image(ImageUrl((allowed / "cat.png").as_uri(), "auto", PARAM))
    assert image.content_hash == (await media.fetch_image(
        ImageUrl(data_url(PNG), "auto", PARAM))).content_hash
    for url in [f"file://{allowed}/../secret.png", (allowed / "link.png").as_uri()]:
        await refused(media, url, "outside the allowed local media path")
    await refused(connector(http), (allowed / "cat.png").as_uri(), "not allowed on this server")


def test_settings_are_checked() -> None:
    assert MediaSettings().limit_for("image") == 999          # vLLM V1's default
    assert MediaSettings(limit_mm_per_prompt='{"image": 4}').limit_for("image") == 4
    for bad in ['{"image": -1}', '["image"]', "{image: 4}"]:
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            MediaSettings(limit_mm_per_prompt=bad)
    with pytest.raises(ValueError, match="not a directory"):
        MediaSettings(allowed_local_media_path="/no/such/dir")


def test_settings_come_from_flags_and_env_like_every_service_setting() -> None:
    flags = parse_settings(MediaSettings, ["--limit-mm-per-prompt", '{"image": 2}',
                                           "--allowed-media-domains", "a.test",
                                           "--allowed-media-domains", "b.test"])
    assert (flags.limit_for("image"), flags.allowed_media_domains) == (2, ["a.test", "b.test"])
    env = build_settings(MediaSettings, {}, {"LLM_MESH_ALLOWED_MEDIA_DOMAINS": "a.test,b.test",
                                             "LLM_MESH_MAX_IMAGE_BYTES": "1000"})
    assert (env.allowed_media_domains, env.max_image_bytes) == (["a.test", "b.test"], 1000)
