"""Bytes -> a canonical PIL image and its content hash, or MediaError."""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps

from services.tokenizer.multimodal.content_hash import hash_image
from services.tokenizer.multimodal.errors import MediaError

# NOTE: only the formats clients send (OpenAI takes PNG, JPEG, WEBP, GIF; the JPEG opener
# also takes phones' multi-picture MPO files); Pillow's other plugins (EPS runs Ghostscript)
# never see user bytes.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image
    content_hash: str


def decode_image(data: bytes, max_pixels: int, param: str) -> DecodedImage:
    """CPU-bound (call it in a thread). Refuses an image over `max_pixels` from its header,
    before its pixels are decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            width, height = opened.size
            if width * height > max_pixels:
                raise MediaError(f"image is {width}x{height}, more than {max_pixels} pixels",
                                 param)
            opened.load()
            image = _canonical(ImageOps.exif_transpose(opened))
    except MediaError:
        raise
    except Image.DecompressionBombError:   # NOTE: Pillow's own limit, met before ours
        raise MediaError(f"image is more than {max_pixels} pixels", param) from None
    except Exception:   # NOTE: Pillow's decoders raise many types (and texts) on bad bytes
        raise MediaError(f"cannot decode the image: not a valid {', '.join(FORMATS)} file",
                         param) from None
    return DecodedImage(image=image, content_hash=hash_image(image))


def _canonical(image: Image.Image) -> Image.Image:
    """Folds a palette or a transparency key into the pixels, so that the raw bytes say
    everything about the image (and the hash over them does too)."""
    if image.mode in ("P", "PA") or "transparency" in image.info:
        return image.convert("RGBA")
    return image
