"""How a scheduler reaches its worker: the local step channel when the worker runs on this
host and listens, NATS otherwise (another host, a channel that cannot be opened, or
--step-transport nats); a step on the channel whose worker dies fails at once."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import structlog

from services.common import wire, wire_pb
from services.common.step_channel import StepChannelServer, host_identity
from services.common.subjects import Subjects
from services.scheduler.worker_link import StepReply, WorkerGone, WorkerLink


def link(step_transport: str = "auto") -> WorkerLink:
    # NOTE: no bus: choosing a transport and stepping over the channel never touch NATS.
    return WorkerLink(None, Subjects("test"), "engine-0",  # type: ignore[arg-type]
                      structlog.get_logger(), step_timeout_s=5.0, heartbeat_timeout_s=5.0,
                      step_transport=step_transport)


def worker_info(channel: str, host_id: str | None = None) -> wire.WorkerInfo:
    return wire.WorkerInfo(engine_id="engine-0", worker_id="w", incarnation=1,
                           host_id=host_identity() if host_id is None else host_id,
                           step_channel=channel)


@pytest.fixture
def channel() -> Iterator[StepChannelServer]:
    def answer(frame: bytes) -> bytes:
        step = wire_pb.StepInput.FromString(frame)
        return wire_pb.StepOutput(step=step.step, execute_s=0.001).SerializeToString()

    server = StepChannelServer(f"llm-mesh-test/{uuid.uuid4().hex}")
    thread = threading.Thread(target=server.serve, args=(answer,), daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(timeout=5)


async def test_a_worker_on_this_host_is_stepped_over_its_channel(
        channel: StepChannelServer) -> None:
    worker = link()
    await worker._on_hello(worker_info(channel.name))
    assert worker.transport == "local"
    reply = await worker.execute(wire_pb.StepInput(step=41), incarnation=1)
    assert reply.output.step == 41 and reply.sent_at < reply.received_at


@pytest.mark.parametrize("why", ["another host", "nothing listens", "told to use NATS"])
async def test_other_workers_are_stepped_over_nats(channel: StepChannelServer, why: str) -> None:
    worker = link("nats" if why == "told to use NATS" else "auto")
    name = f"llm-mesh-test/{uuid.uuid4().hex}" if why == "nothing listens" else channel.name
    await worker._on_hello(worker_info(name, "another-boot/1" if why == "another host" else None))
    assert worker.transport == "nats"


async def test_a_step_whose_worker_stops_fails_at_once(channel: StepChannelServer) -> None:
    worker = link()
    await worker._on_hello(worker_info(channel.name))
    channel.stop()
    with pytest.raises(WorkerGone):
        await worker.execute(wire_pb.StepInput(step=1), incarnation=1)
    assert not worker.is_alive   # it waits for the worker's next start, not a heartbeat lapse


def test_step_hops_split_the_messaging_and_leave_out_the_wait_for_the_step_before() -> None:
    output = wire_pb.StepOutput(execute_s=0.020, worker_received_at=10.030,
                                worker_sent_at=10.0502)
    # Sent at 10.000 while the step before ran until 10.0299 on the worker.
    hops = StepReply(output, sent_at=10.000, received_at=10.0503).hops(
        worker_free_at=10.0299, taken_at=10.0505)
    assert hops is not None
    assert hops.to_worker == pytest.approx(0.0001)
    assert hops.worker == pytest.approx(0.0002)
    assert hops.back == pytest.approx(0.0001)
    assert hops.to_loop == pytest.approx(0.0002)
    # Over NATS the worker leaves its marks out: another host's clock is not ours.
    assert StepReply(wire_pb.StepOutput(execute_s=0.02), 1.0, 2.0).hops(0.0, 2.1) is None
