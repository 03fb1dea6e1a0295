"""A request's state lives in the scheduler instance that accepted it, which is not always
the one the gateway's view names: a restarted scheduler's old instance stays in the view
until the sweep drops it."""

from __future__ import annotations

import asyncio

from services.common import wire
from services.common.subjects import Subjects
from services.frontend.engine_client.generation import TextDelta
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import MeshView


class RestartedEngine:
    """Engine e0's submit subject, now served by a new scheduler instance."""

    async def request(self, subject: str, message: object, reply_type: type,
                      timeout: float) -> wire.SubmitReply:
        return wire.SubmitReply(accepted=True, scheduler_id="s-new")

    async def publish(self, subject: str, message: object) -> None:
        pass


async def test_a_request_is_filed_under_the_scheduler_instance_that_accepted_it() -> None:
    view = MeshView(stale_after_s=60.0)
    view.on_heartbeat(wire.Heartbeat(service="scheduler", instance_id="s-old", ready=True,
                                     engine_id="e0", engine=wire.EngineInfo(model="m")))
    client = MeshClient(RestartedEngine(), Subjects("test"), "g1", view,  # type: ignore[arg-type]
                        5.0, 5.0)
    queue: asyncio.Queue[TextDelta] = asyncio.Queue()
    generation = await client.submit(view.ready_engines()[0],
                                     wire.GenerateRequest(request_id="cmpl-1-0-0"), 0, queue)
    assert (generation.engine_id, generation.scheduler_id) == ("e0", "s-new")
    old = next(i for i in view.instances.values() if i.instance_id == "s-old")
    assert client.fail_instance(old) == 0   # sweeping the dead instance moves nothing
    assert not generation.moving and not generation.finished
