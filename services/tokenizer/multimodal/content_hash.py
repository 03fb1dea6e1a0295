"""An image's identity for caching: sha256 over its decoded pixels, not its encoding.

The same picture sent as a data: URL or fetched by http hashes the same; two images hash the
same only when their mode, size and every pixel byte agree (the parts are length-delimited, so
no two different (mode, size, pixels) can produce the same byte stream).
"""

from __future__ import annotations

import hashlib

from PIL import Image


def hash_image(image: Image.Image) -> str:
    # NOTE: the caller hands in a canonical image (no palette, no side-band transparency;
    # see image_decoder), so mode + size + raw pixels is everything the model will see.
    digest = hashlib.sha256()
    mode = image.mode.encode()
    digest.update(len(mode).to_bytes(1, "little") + mode)
    digest.update(image.width.to_bytes(4, "little") + image.height.to_bytes(4, "little"))
    digest.update(image.tobytes())
    return digest.hexdigest()
