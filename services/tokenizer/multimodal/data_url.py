"""`data:image/<type>;base64,<payload>` URLs: the image travels inside the request."""

from __future__ import annotations

import base64
import binascii

from services.tokenizer.multimodal.errors import MediaError


def decode_data_url(url: str, max_bytes: int, param: str) -> bytes:
    header, comma, payload = url.removeprefix("data:").partition(",")
    media_type, *options = header.split(";")
    if not comma or "base64" not in options:
        raise MediaError("data: URLs must be base64 (data:image/png;base64,...)", param)
    if not media_type.lower().startswith("image/"):
        raise MediaError(f"data: URL has media type {media_type!r}, not an image/* type",
                         param)
    # NOTE: checked before decoding, so an oversized payload is never copied again.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise MediaError(f"image is larger than {max_bytes} bytes", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise MediaError(f"data: URL is not valid base64: {exc}", param) from None
    if len(data) > max_bytes:
        raise MediaError(f"image is larger than {max_bytes} bytes", param)
    return data
