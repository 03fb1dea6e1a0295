"""Each kind of call the mesh client makes waits its own bound: a tokenizer's answer
--tokenizer-timeout-s, a scheduler's acceptance of a submit (and an admin command)
--engine-submit-timeout-s."""

from __future__ import annotations

import asyncio

from services.common import wire
from services.common.subjects import Subjects
from services.frontend.engine_client.generation import TextDelta
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import MeshView

SUBJECTS = Subjects("test")


class RecordingBus:
    """Answers every request at once and records how long its caller would have waited."""

    def __init__(self) -> None:
        self.timeouts: dict[str, float] = {}

    async def request(self, subject: str, message: object, reply_type: type,
                      timeout: float) -> object:
        self.timeouts[subject] = timeout
        if reply_type is wire.SubmitReply:
            return wire.SubmitReply(accepted=True, scheduler_id="s-0")
        return reply_type()

    async def publish(self, subject: str, message: object) -> None:
        pass


async def test_tokenizer_calls_and_engine_submits_wait_their_own_bounds() -> None:
    view = MeshView(stale_after_s=60.0)
    view.on_heartbeat(wire.Heartbeat(service="scheduler", instance_id="s-0", ready=True,
                                     engine_id="e0", engine=wire.EngineInfo(model="m")))
    bus = RecordingBus()
    client = MeshClient(bus, SUBJECTS, "g1", view, 2.0, 7.0)  # type: ignore[arg-type]
    await client.encode(wire.EncodeRequest(prompt="hi"))
    queue: asyncio.Queue[TextDelta] = asyncio.Queue()
    await client.submit(view.ready_engines()[0], wire.GenerateRequest(request_id="r-0"), 0,
                        queue)
    await client.admin("e0", "reset_prefix_cache")
    assert bus.timeouts == {SUBJECTS.tokenizer_encode: 2.0, SUBJECTS.engine_submit("e0"): 7.0,
                            SUBJECTS.engine_admin("e0"): 7.0}
