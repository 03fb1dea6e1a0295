"""Which engine a request queued past the bound moves to, if any (no mesh): prefill work
there — its queue plus the prompt tokens it lacks — against the work still ahead where the
request waits, the KV router's count of what each engine holds of a prompt, and a request
moved for queueing once only."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from services.common import wire
from services.common.subjects import Subjects
from services.frontend.engine_client.generation import Generation
from services.frontend.engine_client.mesh_client import MeshClient, queue_move_target
from services.frontend.engine_client.mesh_view import EngineView, MeshView
from tests.frontend.test_stall_watchdog import FakeBus
from tests.router.test_engine_router import engine, router, tokens

HISTORY = 3_400        # a long conversation's prompt
SYSTEM_PROMPT = 512    # the part every engine holds


def queued_on(engine_id: str, waiting_tokens: int, **fields: int) -> EngineView:
    """An engine whose queue holds `waiting_tokens` prompt tokens (the request's included)."""
    return dataclasses.replace(engine(engine_id), num_waiting=2,
                               num_waiting_tokens=waiting_tokens, **fields)


def test_a_history_cached_where_it_waits_stays_behind_a_short_queue() -> None:
    here = queued_on("e0", HISTORY + 2_000)
    there = engine("e1")
    cached = {"e0": HISTORY - 200, "e1": SYSTEM_PROMPT}
    # Here: 2,000 queued tokens + 200 of its own; there: 2,888 tokens to recompute.
    assert queue_move_target(here, [there], HISTORY, cached) is None


def test_it_moves_once_the_queue_ahead_outweighs_the_recompute() -> None:
    here = queued_on("e0", HISTORY + 8_000, num_running_prefill_tokens=500)
    there = engine("e1")
    cached = {"e0": HISTORY - 200, "e1": SYSTEM_PROMPT}
    assert queue_move_target(here, [there], HISTORY, cached) is there


def test_a_queue_bound_by_sequence_slots_moves_whatever_the_tokens() -> None:
    # Every slot taken by long decodes: the wait is for one of them to end.
    here = queued_on("e0", HISTORY, num_running=4, max_num_seqs=4)
    there = engine("e1")
    assert queue_move_target(here, [there], HISTORY, {"e0": HISTORY}) is there
    assert queue_move_target(queued_on("e0", HISTORY, num_running=3, max_num_seqs=4),
                             [there], HISTORY, {"e0": HISTORY}) is None


def test_of_engines_with_room_the_one_holding_more_of_the_prompt_wins() -> None:
    here = queued_on("e0", HISTORY + 20_000)
    cold, warm = engine("e1"), engine("e2")
    cached = {"e1": SYSTEM_PROMPT, "e2": 2_048}
    assert queue_move_target(here, [cold, warm], HISTORY, cached) is warm
    # ... unless its own queue costs more than the tokens it saves.
    busy_warm = dataclasses.replace(warm, num_running_prefill_tokens=2_000)
    assert queue_move_target(here, [cold, busy_warm], HISTORY, cached) is cold


def test_without_cache_knowledge_queues_of_raw_tokens_decide() -> None:
    # The least-loaded and round-robin modes know nothing cached anywhere.
    there = engine("e1")
    assert queue_move_target(queued_on("e0", HISTORY + 100), [there], HISTORY, {}) is there
    assert queue_move_target(queued_on("e0", HISTORY), [there], HISTORY, {}) is None
    assert queue_move_target(queued_on("e0", HISTORY + 100), [], HISTORY, {}) is None


def test_the_router_says_how_much_of_a_prompt_each_engine_holds() -> None:
    kv = router()
    engines = [engine("e0"), engine("e1")]
    history = tokens(3)
    assert kv.route(engines, history).engine.engine_id == "e0"
    turn = np.concatenate([history, tokens(4, 40)])
    assert kv.cached_tokens(engines, turn) == {"e0": len(history), "e1": 0}
    assert kv.cached_tokens(engines, turn, cache_salt="another tenant") == {"e0": 0, "e1": 0}


class MoveRecorder:
    """Stands for the Migrator: records each move and places the request where it went."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str | None, str | None]] = []

    def move(self, generations: list[Generation], reason: str, *, away_from: str | None = None,
             to_engine: str | None = None, stalled_engine: str | None = None) -> None:
        for generation in generations:
            self.moves.append((generation.request_id, away_from, to_engine))
            generation.engine_id = to_engine or generation.engine_id
            generation.placed_at = time.monotonic() - 60.0   # queued again, past the bound


def queue_beat(engine_id: str, num_waiting: int, num_running_prefill_tokens: int = 0
               ) -> wire.Heartbeat:
    return wire.Heartbeat(service="scheduler", instance_id=f"s-{engine_id}", ready=True,
                          engine_id=engine_id, engine=wire.EngineInfo(
                              model="m", max_model_len=8192, block_size=16, num_blocks=1000,
                              num_running=1, num_waiting=num_waiting,
                              num_waiting_tokens=num_waiting * HISTORY,
                              num_running_prefill_tokens=num_running_prefill_tokens,
                              worker_ready=True, num_steps=1, max_num_seqs=8))


async def test_a_request_moves_for_queueing_once_and_never_back() -> None:
    """Past capacity both engines queue in turn: a turn moved off e0 sits in e1's long
    prefill, where the gateway cannot tell it from queued. Moved again, it would throw that
    prefill away and recompute on e0."""
    view = MeshView(stale_after_s=60.0, stall_after_s=0.0)
    view.on_heartbeat(queue_beat("e0", num_waiting=3))
    view.on_heartbeat(queue_beat("e1", num_waiting=0))
    client = MeshClient(FakeBus(), Subjects("test"), "g1", view, 5.0, 5.0)  # type: ignore[arg-type]
    recorder = MoveRecorder()
    client.migrator = recorder  # type: ignore[assignment]
    e0 = next(e for e in view.ready_engines() if e.engine_id == "e0")
    request = wire.GenerateRequest(request_id="cmpl-1-0-0",
                                   prompt_token_ids=np.zeros(HISTORY, np.int32).tobytes(),
                                   sampling=wire.SamplingParams(max_tokens=8))
    generation = await client.submit(e0, request, 0, asyncio.Queue())
    generation.detokenize, generation.model = wire.DetokenizeParams(), "m"
    generation.placed_at -= 60.0
    assert client.move_queued(15.0, 0.9) == 1
    assert recorder.moves == [("cmpl-1-0-0", "e0", "e1")]
    # Now e1 is busy with it and more, e0 has drained: it stays.
    view.on_heartbeat(queue_beat("e1", num_waiting=3, num_running_prefill_tokens=HISTORY))
    view.on_heartbeat(queue_beat("e0", num_waiting=0))
    assert client.move_queued(15.0, 0.9) == 0 and len(recorder.moves) == 1
