"""`python -m services.kvstore` (what `llm-mesh serve kvstore` runs)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.service import run_service
from services.common.settings import parse_settings
from services.kvstore.service import KVStoreService
from services.kvstore.settings import KVStoreSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(KVStoreSettings, argv, prog="llm-mesh serve kvstore",
                              description="A kvstore node: KV blocks in CPU memory and on disk, "
                              "served over gRPC, indexed in Redis.")
    run_service(KVStoreService(settings))


if __name__ == "__main__":
    main()
