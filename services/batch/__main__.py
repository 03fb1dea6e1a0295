"""`python -m services.batch` (what `llm-mesh serve batch` runs)."""

from __future__ import annotations

from collections.abc import Sequence

from services.batch.service import BatchService
from services.batch.settings import BatchSettings
from services.common.service import run_service
from services.common.settings import parse_settings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(BatchSettings, argv, prog="llm-mesh serve batch",
                              description="The batch-job runner: takes jobs from JetStream and "
                              "runs their lines in the mesh at a low priority.")
    run_service(BatchService(settings))


if __name__ == "__main__":
    main()
