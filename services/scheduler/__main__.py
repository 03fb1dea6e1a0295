"""`python -m services.scheduler` (what `llm-mesh serve scheduler` runs)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.service import run_service
from services.common.settings import parse_settings
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(SchedulerSettings, argv, prog="llm-mesh serve scheduler",
                              description="One engine's scheduler: queues, KV blocks, steps.")
    run_service(SchedulerService(settings))


if __name__ == "__main__":
    main()
