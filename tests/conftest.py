"""Shared fixtures: a real mesh (NATS + every service as a process) for end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mesh import Mesh


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    running = Mesh(Path(tmp_path_factory.mktemp("mesh")))
    try:
        running.start()
    except Exception:
        print(running.logs())
        running.stop()
        raise
    yield running
    codes = running.stop()
    # uvicorn re-raises SIGTERM after a clean shutdown (-15); every other service exits 0.
    assert all(code in (0, -15) for code in codes.values()), (codes, running.logs())
