"""Decoding and content hashes: the hash follows the pixels, never the encoding."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from services.tokenizer.multimodal import MediaError, decode_image
from tests.tokenizer.multimodal.images import encode, noise_image

MAX_PIXELS = 10_000_000


def content_hash(data: bytes) -> str:
    return decode_image(data, MAX_PIXELS, "p").content_hash


def test_the_same_pixels_hash_the_same_in_any_lossless_encoding() -> None:
    image = noise_image(17, 9)
    encodings = [encode(image, "PNG"), encode(image, "BMP"), encode(image, "TIFF"),
                 encode(image, "WEBP", lossless=True, exact=True)]
    assert len(set(encodings)) == len(encodings)
    assert len({content_hash(data) for data in encodings}) == 1


def test_different_images_hash_differently() -> None:
    pixels = np.zeros((4, 6), dtype=np.uint8)
    changed = pixels.copy()
    changed[3, 5] = 1
    same_bytes_other_shape = pixels.reshape(6, 4)
    images = [Image.fromarray(pixels), Image.fromarray(changed),
              Image.fromarray(same_bytes_other_shape),
              Image.frombytes("RGB", (2, 4), bytes(24)),       # same 24 zero bytes as RGB
              noise_image(6, 4, seed=1), noise_image(6, 4, seed=2)]
    hashes = [content_hash(encode(image)) for image in images]
    assert len(set(hashes)) == len(images)


def test_palettes_and_transparency_are_part_of_the_pixels() -> None:
    indices = Image.fromarray(np.arange(16, dtype=np.uint8).reshape(4, 4))
    red, blue = indices.convert("P"), indices.convert("P")
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)
    assert red.tobytes() == blue.tobytes()            # the same indices, other colours
    decoded = decode_image(encode(red), MAX_PIXELS, "p")
    assert decoded.image.mode == "RGBA"
    assert decoded.content_hash != content_hash(encode(blue))


def test_exif_orientation_is_applied() -> None:
    image = noise_image(20, 10)
    exif = Image.Exif()
    exif[0x0112] = 6                      # rotate 90° clockwise to display
    rotated = encode(image, "JPEG", exif=exif.tobytes())
    assert decode_image(rotated, MAX_PIXELS, "p").image.size == (10, 20)


def png_claiming_size(width: int, height: int) -> bytes:
    """A PNG whose header (with a valid CRC) claims width x height, and whose pixels are junk:
    only a check made from the header alone can answer it with the size."""
    data = bytearray(encode(noise_image(2, 2)))
    ihdr = 8 + 4                                   # signature, then the chunk's length
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr:ihdr + 4 + 13]))
    data[ihdr + 4 + 13:ihdr + 4 + 17] = struct.pack(">I", crc)
    return bytes(data)


@pytest.mark.parametrize("width, height", [(5000, 3000), (100_000, 100_000)])
def test_oversized_dimensions_are_refused_from_the_header(width: int, height: int) -> None:
    # NOTE: the second is past Pillow's own decompression-bomb limit too.
    with pytest.raises(MediaError, match=f"more than {MAX_PIXELS} pixels") as caught:
        decode_image(png_claiming_size(width, height), MAX_PIXELS, "the.param")
    assert caught.value.param == "the.param"


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n", encode(noise_image(8, 8))[:-30],
                                  encode(noise_image(8, 8), "PPM")],
                         ids=["empty", "signature-only", "truncated", "format-not-allowed"])
def test_bad_bytes_are_one_error(data: bytes) -> None:
    with pytest.raises(MediaError, match="cannot decode"):
        decode_image(data, MAX_PIXELS, "p")
