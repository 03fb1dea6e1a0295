"""The gateway's settings: the shared request path's, and its HTTP server's."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import setting
from services.frontend.settings import FrontendSettings


@dataclass
class GatewaySettings(FrontendSettings):
    host: str = setting("127.0.0.1", "HTTP bind address of the OpenAI-compatible API")
    port: int = setting(8000, "HTTP port of the OpenAI-compatible API")
    max_body_bytes: int = setting(8 * 1024 * 1024, "Largest request body accepted (413 beyond)")
