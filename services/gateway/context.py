"""What every gateway handler needs, in one object."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.mesh_client import MeshClient
from services.gateway.mesh_view import MeshView
from services.gateway.settings import GatewaySettings


@dataclass
class GatewayContext:
    settings: GatewaySettings
    client: MeshClient
    view: MeshView
