"""The gateway's stall watchdog: which requests it finds stalled (MeshView's rule, from the
engines' step counts in their heartbeats), and where a request moved off a stalled engine
goes (services/frontend/engine_client/migration.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from prometheus_client import CollectorRegistry

from services.common import wire
from services.common.metrics import GatewayMetrics
from services.common.subjects import Subjects
from services.frontend.engine_client.generation import Generation, TextDelta
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import EngineView, MeshView
from services.frontend.engine_client.migration import Migrator
from tests.frontend.test_mesh_view import Clock
from tests.waiting import until

STALL_S = 10.0


def engine_beat(engine_id: str, num_steps: int, running: int = 1,
                worker_ready: bool = True) -> wire.Heartbeat:
    return wire.Heartbeat(service="scheduler", instance_id=f"s-{engine_id}", ready=worker_ready,
                          engine_id=engine_id, engine=wire.EngineInfo(
                              model="m", max_model_len=2048, num_running=running,
                              num_steps=num_steps, worker_ready=worker_ready))


def beat_for(view: MeshView, clock: Clock, seconds: int, engine_id: str, *,
             stepping: bool, running: int = 1, first_step: int = 0) -> None:
    """One heartbeat a second for `seconds`, the step count moving or standing still."""
    for i in range(seconds):
        clock.now += 1.0
        view.on_heartbeat(engine_beat(engine_id, first_step + (i if stepping else 0), running))


def test_a_request_queued_on_a_stepping_engine_is_not_stalled() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.5, stall_after_s=STALL_S, clock=clock)
    placed = clock.now
    beat_for(view, clock, 30, "e0", stepping=True, running=8)
    assert not view.is_request_stalled("e0", placed)       # silent 30 s, but others step
    assert not view.ready_engines()[0].is_stalled


def test_a_request_on_an_engine_that_stopped_stepping_is_stalled() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.5, stall_after_s=STALL_S, clock=clock)
    beat_for(view, clock, 5, "e0", stepping=True)
    last_output = clock.now
    beat_for(view, clock, 9, "e0", stepping=False, first_step=4)
    assert not view.is_request_stalled("e0", last_output)    # not yet the stall timeout
    beat_for(view, clock, 2, "e0", stepping=False, first_step=4)
    assert view.is_request_stalled("e0", last_output)
    assert view.ready_engines()[0].is_stalled               # new requests go elsewhere first
    assert not view.is_request_stalled("e0", clock.now - 1)  # output a second ago: not silent


def test_an_idle_engine_or_one_without_its_worker_or_gone_stalls_a_silent_request() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.5, stall_after_s=STALL_S, clock=clock)
    placed = clock.now
    beat_for(view, clock, 12, "idle", stepping=False, running=0)   # it lost the request
    view.on_heartbeat(engine_beat("no-worker", 7, worker_ready=False))
    assert view.is_request_stalled("idle", placed)
    assert view.is_request_stalled("no-worker", placed)
    assert view.is_request_stalled("gone", placed)


def test_the_watchdog_is_off_at_zero() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.5, stall_after_s=0.0, clock=clock)
    beat_for(view, clock, 60, "e0", stepping=False)
    assert not view.is_request_stalled("e0", 0.0)
    assert not view.ready_engines()[0].is_stalled


def test_an_engine_that_gets_work_while_idle_is_not_stalled_before_its_first_step() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.5, stall_after_s=STALL_S, clock=clock)
    beat_for(view, clock, 30, "e0", stepping=False, running=0)
    view.on_heartbeat(engine_beat("e0", 0, running=1))     # work arrived; no step yet
    assert not view.ready_engines()[0].is_stalled


def test_stalled_engines_are_picked_last_and_avoided_engines_never() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=60.0, stall_after_s=STALL_S, clock=clock)
    for _ in range(12):
        clock.now += 1.0
        view.on_heartbeat(engine_beat("hung", 3, running=1))
        view.on_heartbeat(engine_beat("busy", int(clock.now), running=20))
    assert pick(view) == "busy"                # more loaded, but stepping
    assert pick(view, avoid=["busy"]) == "hung"
    assert view.pick_engine("m", ["busy", "hung"]) is None


def pick(view: MeshView, avoid: list[str] | None = None) -> str:
    engine = view.pick_engine("m", avoid or [])
    assert isinstance(engine, EngineView)
    return engine.engine_id


class FakeMeshClient:
    """What the Migrator calls on the mesh client, recording where requests go."""

    def __init__(self) -> None:
        self.placed: list[str] = []
        self.errors: list[str] = []

    async def detach(self, generation: Generation) -> None:
        pass

    async def encode(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        return wire.EncodeReply(tokenizer_id="t1")

    async def place(self, generation: Generation, engine: EngineView,
                    request: wire.GenerateRequest) -> None:
        generation.engine_id, generation.request_id = engine.engine_id, request.request_id
        self.placed.append(engine.engine_id)

    async def release(self, tokenizer_id: str, request_ids: list[str]) -> None:
        pass

    def finish_with_error(self, generation: Generation, message: str) -> None:
        generation.finished = True
        self.errors.append(message)


def running_generation(engine_id: str) -> Generation:
    request = wire.GenerateRequest(request_id="cmpl-1-0-0", prompt_token_ids=b"\x01\0\0\0",
                                   sampling=wire.SamplingParams(max_tokens=8))
    return Generation("cmpl-1-0-0", 0, engine_id, f"s-{engine_id}", "t1",
                      asyncio.Queue(), request=request, detokenize=wire.DetokenizeParams(),
                      model="m")


async def test_a_stalled_request_moves_to_another_ready_engine() -> None:
    view = MeshView(stale_after_s=60.0, stall_after_s=STALL_S)
    view.on_heartbeat(engine_beat("e0", 3))
    view.on_heartbeat(engine_beat("e1", 9, running=5))   # more loaded than e0
    client = FakeMeshClient()
    migrator = Migrator(client, view, 5.0, None)  # type: ignore[arg-type]
    generation = running_generation("e0")
    migrator.move([generation], "engine stalled", stalled_engine="e0")
    await until(lambda: not generation.moving)
    assert client.placed == ["e1"] and generation.request_id == "cmpl-1-0-0.m1"


class RecordingView(MeshView):
    """A MeshView that records what each pick_engine call was told to avoid."""

    def __init__(self) -> None:
        super().__init__(stale_after_s=60.0, stall_after_s=STALL_S)
        self.avoided: list[list[str]] = []

    def pick_engine(self, model: str, avoid: Collection[str] = (), needs_lora: bool = False,
                    prefer: str | None = None) -> EngineView | None:
        self.avoided.append(list(avoid))
        return super().pick_engine(model, avoid, needs_lora, prefer)


def stall_on_the_only_engine(migration_timeout_s: float) -> tuple[RecordingView,
                                                                 FakeMeshClient, Generation]:
    """A mesh of one engine, e0, whose request the watchdog has just started to move."""
    view = RecordingView()
    view.on_heartbeat(engine_beat("e0", 3))
    client = FakeMeshClient()
    migrator = Migrator(client, view, migration_timeout_s, None)  # type: ignore[arg-type]
    generation = running_generation("e0")
    migrator.move([generation], "engine stalled", stalled_engine="e0")
    return view, client, generation


async def test_with_no_other_engine_a_stalled_request_waits_for_its_engine_to_step() -> None:
    view, client, generation = stall_on_the_only_engine(5.0)
    await until(lambda: len(view.avoided) >= 3 or client.placed)  # a try, two retries
    assert view.avoided[:3] == [["e0"]] * 3              # each kept off the hung engine
    assert client.placed == [] and generation.moving
    view.on_heartbeat(engine_beat("e0", 4))              # it stepped: not hung any more
    await until(lambda: not generation.moving)
    assert client.placed == ["e0"] and not client.errors


async def test_a_stalled_request_with_nowhere_to_go_ends_with_the_retriable_error() -> None:
    _, client, generation = stall_on_the_only_engine(0.5)
    await until(lambda: not generation.moving)
    assert client.placed == [] and generation.finished
    assert client.errors[0].startswith("engine stalled and no replacement took over")


class FakeBus:
    """Engines that accept every submit."""

    async def request(self, subject: str, message: object, reply_type: type,
                      timeout: float) -> wire.SubmitReply:
        return wire.SubmitReply(accepted=True)


class RecordingMigrator:
    def __init__(self) -> None:
        self.moves: list[tuple[str, str, str | None]] = []

    def move(self, generations: list[Generation], reason: str,
             stalled_engine: str | None = None) -> None:
        self.moves += [(g.request_id, reason, stalled_engine) for g in generations]


async def test_move_stalled_moves_only_silent_requests_of_engines_without_progress() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=60.0, stall_after_s=STALL_S, clock=clock)
    view.on_heartbeat(engine_beat("e0", 3))
    view.on_heartbeat(engine_beat("e1", 3, running=9))
    registry = CollectorRegistry()
    client = MeshClient(FakeBus(), Subjects("test"), "g1", view, 5.0, 5.0,  # type: ignore[arg-type]
                        metrics=GatewayMetrics(registry))
    client.migrator = RecordingMigrator()  # type: ignore[assignment]
    queue: asyncio.Queue[TextDelta] = asyncio.Queue()
    for engine_id, request_id in (("e0", "cmpl-1-0-0"), ("e1", "cmpl-2-0-0")):
        engine = next(e for e in view.ready_engines() if e.engine_id == engine_id)
        generation = await client.submit(engine, wire.GenerateRequest(request_id=request_id),
                                          0, queue)
        generation.last_output_at = clock.now
    for _ in range(11):
        clock.now += 1.0
        view.on_heartbeat(engine_beat("e0", 3))                       # hung
        view.on_heartbeat(engine_beat("e1", int(clock.now), running=9))  # busy, stepping
    assert client.move_stalled() == 1
    assert client.migrator.moves == [("cmpl-1-0-0", "engine stalled", "e0")]
    assert registry.get_sample_value("llm_mesh:request_stalls_total") == 1
