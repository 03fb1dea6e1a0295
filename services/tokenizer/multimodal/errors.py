"""The one error type of multimodal input: whatever is wrong with an image the client sent."""

from __future__ import annotations


class MediaError(ValueError):
    """Bad or refused media in a request (an unreadable URL, a host not allowed, a corrupt or
    oversized image, too many images). The gateway answers it with HTTP 400 and an
    OpenAI-style error whose `param` names the offending content part."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
