"""Shared fixtures: a real mesh (NATS + every service as a process) for end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mesh import Mesh, serving


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with serving(Mesh(Path(tmp_path_factory.mktemp("mesh")))) as running:
        yield running
