"""`python -m services.gateway` (what `llm-mesh serve gateway` runs)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.service import run_service
from services.common.settings import parse_settings
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(GatewaySettings, argv, prog="llm-mesh serve gateway",
                              description="The OpenAI-compatible HTTP API of the mesh.")
    run_service(GatewayService(settings))


if __name__ == "__main__":
    main()
