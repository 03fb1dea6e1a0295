"""Shared fixtures: a real mesh (NATS + every service as a process) for end-to-end tests.
A failing test that used a mesh gets the tail of each service's log in its report, so a
failure seen only in CI can be read from CI's output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mesh import Mesh, serving

LOG_LINES_ON_FAILURE = 25


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with serving(Mesh(Path(tmp_path_factory.mktemp("mesh")))) as running:
        yield running


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    if report.failed and call.when == "call":
        for fixture in getattr(item, "funcargs", {}).values():
            for mesh in (fixture, *(fixture if isinstance(fixture, tuple) else ())):
                for service in getattr(mesh, "services", {}).values():
                    if hasattr(service, "log_tail"):
                        report.sections.append((f"{service.name} log (tail)",
                                                service.log_tail(LOG_LINES_ON_FAILURE)))
    return report
