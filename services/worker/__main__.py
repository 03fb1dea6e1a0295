"""`python -m services.worker` (what `llm-mesh serve worker` runs)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.service import run_service
from services.common.settings import parse_settings
from services.worker.service import WorkerService
from services.worker.settings import WorkerSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(WorkerSettings, argv, prog="llm-mesh serve worker",
                              description="Model weights, KV cache, forward passes, sampling.")
    run_service(WorkerService(settings))


if __name__ == "__main__":
    main()
