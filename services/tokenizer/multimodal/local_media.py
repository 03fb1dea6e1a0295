"""`file://` image URLs, read only from under --allowed-local-media-path."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from services.tokenizer.multimodal.errors import MediaError


def read_local_media(url: str, allowed_dir: str, max_bytes: int, param: str) -> bytes:
    """Blocking (call it in a thread). The path is resolved first, symlinks and `..`
    included, so nothing outside `allowed_dir` can be named."""
    if not allowed_dir:
        raise MediaError("file:// URLs are not allowed on this server", param)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// URLs must name a local path (file:///...)", param)
    root = Path(allowed_dir).resolve()
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise MediaError("file:// URL is outside the allowed local media path", param)
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise MediaError(f"cannot read {parts.path}: {exc.strerror}", param) from None
    if len(data) > max_bytes:
        raise MediaError(f"image is larger than {max_bytes} bytes", param)
    return data
