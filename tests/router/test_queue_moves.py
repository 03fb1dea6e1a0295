"""Which engine a request queued past the bound moves to, if any (no mesh): prefill work
there — its queue plus the prompt tokens it lacks — against the work still ahead where the
request waits, and the KV router's count of what each engine holds of a prompt."""

from __future__ import annotations

import dataclasses

import numpy as np

from services.common.frontend.mesh_client import queue_move_target
from services.common.frontend.mesh_view import EngineView
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
