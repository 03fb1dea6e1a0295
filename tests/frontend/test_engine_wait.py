"""A request arriving while no engine is ready waits for one (up to --engine-wait-s) instead
of failing: an engine starting, restarting, or with a late heartbeat costs a wait, not a 503.
A model that no ready engine serves is a 404 at once."""

from __future__ import annotations

import asyncio

import pytest

from services.frontend.engine_client.mesh_view import MeshView
from services.frontend.engine_client.request_run import RequestRun
from services.frontend.errors import ApiError
from tests.frontend.test_mesh_view import beat


def run_on(view: MeshView, engine_wait_s: float) -> RequestRun:
    return RequestRun(client=None, view=view, request_id="r-1",  # type: ignore[arg-type]
                         request_timeout_s=60.0, timer=None,  # type: ignore[arg-type]
                         engine_wait_s=engine_wait_s)


async def test_a_request_waits_until_an_engine_is_ready() -> None:
    view = MeshView(stale_after_s=60.0)
    waiting = asyncio.create_task(run_on(view, engine_wait_s=60.0)._wait_for_an_engine("m"))
    await asyncio.sleep(0)   # it has looked once, found none, and waits
    assert not waiting.done()
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e0"))
    await asyncio.wait_for(waiting, timeout=5.0)


async def test_no_engine_within_the_wait_is_a_503() -> None:
    with pytest.raises(ApiError) as raised:
        await run_on(MeshView(stale_after_s=60.0), engine_wait_s=0.3)._wait_for_an_engine("m")
    assert raised.value.status == 503 and raised.value.code == "engine_unavailable"


async def test_a_model_no_engine_serves_is_a_404_without_waiting() -> None:
    view = MeshView(stale_after_s=60.0)
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e0", model="m"))
    with pytest.raises(ApiError) as raised:
        await asyncio.wait_for(run_on(view, engine_wait_s=60.0)._wait_for_an_engine("other"),
                               timeout=5.0)
    assert raised.value.status == 404 and raised.value.code == "model_not_found"
