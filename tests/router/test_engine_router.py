"""The gateway's engine router on views of engines (no mesh): KV overlap from events and
from its own predictions, cold prompts spread, pending prefills counted, sessions kept and
spilled, and the plain modes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry

from services.common import wire
from services.common.block_hash import BlockHasher
from services.common.metrics import RouterMetrics
from services.frontend.engine_client.mesh_view import EngineView
from services.frontend.router import ApproximateIndex, PrefixIndex
from services.frontend.router.engine_router import RELEASE_MAX_AGE_S, EngineRouter, RouterMode
from services.frontend.router.session_table import SessionTable

BLOCK_SIZE = 16
CLEARED = [wire.KvEvent(cleared=wire.AllBlocksCleared())]   # a scheduler's first batch


def engine(engine_id: str, kv_cache_usage: float = 0.0, num_running: int = 0) -> EngineView:
    return EngineView(engine_id=engine_id, scheduler_id=f"sched-{engine_id}", model="m",
                      max_model_len=2048, num_running=num_running, num_waiting=0,
                      kv_cache_usage=kv_cache_usage, block_size=BLOCK_SIZE, num_blocks=1000)


def tokens(seed: int, count: int = 8 * BLOCK_SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, count, dtype=np.int32)


def router(mode: RouterMode = RouterMode.KV, busy: float = 0.9,
           metrics: RouterMetrics | None = None,
           wall_clock: Callable[[], float] = time.time,
           history_weight: float = 1.0) -> EngineRouter:
    return EngineRouter(mode, PrefixIndex(), ApproximateIndex(60.0), SessionTable(60.0),
                        session_busy_threshold=busy, metrics=metrics, wall_clock=wall_clock,
                        session_history_weight=history_weight)


def stored(prompt: np.ndarray) -> list[wire.KvEvent]:
    hashes = BlockHasher(BLOCK_SIZE).hash_blocks(prompt)
    return [wire.KvEvent(stored=wire.BlockStored(block_hashes=hashes))]


def test_a_prompt_goes_where_kv_events_say_its_prefix_is() -> None:
    kv = router()
    engines = [engine("e0"), engine("e1", kv_cache_usage=0.004)]   # 4 blocks busy
    history = tokens(1)
    kv.index.apply("sched-e1", stored(history))
    kv.index.apply("sched-e0", stored(tokens(2)))
    route = kv.route(engines, np.concatenate([history, tokens(3, 20)]))
    assert route.engine.engine_id == "e1" and route.reason == "kv_overlap"
    assert route.num_predicted_cached_tokens == len(history)
    assert route.num_pending_blocks == 2     # 20 new tokens: two blocks to prefill


def test_load_outweighs_a_small_overlap() -> None:
    kv = router()
    prompt = tokens(4)
    kv.index.apply("sched-e0", stored(prompt[:BLOCK_SIZE]))
    kv.index.apply("sched-e1", CLEARED)
    busy, idle = engine("e0", kv_cache_usage=0.5), engine("e1")
    assert kv.route([busy, idle], prompt).engine.engine_id == "e1"


def test_a_long_prefill_still_running_counts_as_load() -> None:
    """With chunked prefill a long prompt runs for many steps before its first token: the
    engine chewing on one is as busy as one with the same tokens queued."""
    kv = router()
    prompt = tokens(7)
    kv.index.apply("sched-e0", stored(prompt[:2 * BLOCK_SIZE]))   # a small overlap on e0
    kv.index.apply("sched-e1", CLEARED)
    chewing = dataclasses.replace(engine("e0"), num_running=1,
                                  num_running_prefill_tokens=3000)
    assert kv.route([chewing, engine("e1")], prompt).engine.engine_id == "e1"
    assert kv.route([engine("e0"), engine("e1")], prompt).engine.engine_id == "e0"


def test_without_events_the_router_predicts_from_its_own_choices() -> None:
    kv = router()
    engines = [engine("e0"), engine("e1")]
    first, second = tokens(5), tokens(6)
    # Cold prompts on idle engines: the emptier cache takes the next one.
    assert kv.route(engines, first).engine.engine_id == "e0"
    assert kv.route(engines, second).engine.engine_id == "e1"
    follow_up = kv.route(engines, np.concatenate([second, tokens(7, 40)]))
    assert follow_up.engine.engine_id == "e1" and follow_up.reason == "kv_overlap"
    assert follow_up.num_predicted_cached_tokens == len(second)


def test_prefills_in_flight_count_until_settled() -> None:
    kv = router()
    kv.index.apply("sched-e0", CLEARED)    # both publish events, neither holds anything yet
    kv.index.apply("sched-e1", CLEARED)
    engines = [engine("e0"), engine("e1")]
    first = kv.route(engines, tokens(8))
    second = kv.route(engines, tokens(9))
    assert {first.engine.engine_id, second.engine.engine_id} == {"e0", "e1"}
    kv.settle(first)
    kv.settle(first)                   # settling twice changes nothing
    kv.settle(second)
    assert kv.route(engines, tokens(10)).engine.engine_id == "e0"


def test_a_session_sticks_then_spills_past_the_busy_threshold() -> None:
    registry = CollectorRegistry()
    kv = router(busy=0.5, metrics=RouterMetrics(registry))
    engines = [engine("e0"), engine("e1")]
    assert kv.route(engines, tokens(11), session_id="s").engine.engine_id == "e0"
    # Unrelated text, an idle other engine: the session keeps its engine.
    kept = kv.route([engine("e0", kv_cache_usage=0.4), engine("e1")], tokens(12),
                    session_id="s")
    assert kept.engine.engine_id == "e0" and kept.reason == "session"
    # Both past the threshold: moving would lose the history and gain nothing.
    stayed = kv.route([engine("e0", kv_cache_usage=0.6), engine("e1", kv_cache_usage=0.7)],
                      tokens(13), session_id="s")
    assert stayed.engine.engine_id == "e0" and stayed.reason == "session"
    queueing = dataclasses.replace(engine("e1"), num_waiting=1)   # its KV is free, not it
    assert kv.route([engine("e0", kv_cache_usage=0.6), queueing], tokens(13),
                    session_id="s").engine.engine_id == "e0"
    spilled = kv.route([engine("e0", kv_cache_usage=0.6), engine("e1")], tokens(13),
                       session_id="s")
    assert spilled.engine.engine_id == "e1" and spilled.reason == "session_spill"
    assert kv.sessions.get("s") == "e1"
    assert registry.get_sample_value("llm_mesh:router_session_spills_total") == 1
    assert registry.get_sample_value("llm_mesh:router_decisions_total",
                                     {"reason": "session"}) == 3


def test_a_session_leaves_a_queueing_engine_that_evicted_its_history() -> None:
    kv = router()
    kv.index.apply("sched-e0", CLEARED)
    kv.index.apply("sched-e1", CLEARED)
    history = tokens(14)
    assert kv.route([engine("e0"), engine("e1")], history, session_id="s").engine.engine_id \
        == "e0"
    kv.index.apply("sched-e0", stored(history))
    next_turn = np.concatenate([history, tokens(15, 2 * BLOCK_SIZE)])
    queueing = dataclasses.replace(engine("e0", num_running=1), num_waiting=2)
    # It still holds the history: the turn waits for it there.
    kept = kv.route([queueing, engine("e1")], next_turn, session_id="s")
    assert kept.engine.engine_id == "e0" and kept.reason == "session"
    # The back half of the history evicted (tail first): an idle engine does better.
    evicted = BlockHasher(BLOCK_SIZE).hash_blocks(history)[4:]
    kv.index.apply("sched-e0", [wire.KvEvent(removed=wire.BlockRemoved(block_hashes=evicted))])
    assert kv.route([engine("e0"), engine("e1")], next_turn,
                    session_id="s").engine.engine_id == "e0"    # not while e0 has room
    moved = kv.route([queueing, engine("e1")], next_turn, session_id="s")
    assert moved.engine.engine_id == "e1" and moved.reason == "session_spill"
    assert kv.sessions.get("s") == "e1"


def test_least_loaded_and_round_robin_modes_ignore_sessions() -> None:
    engines = [engine("e0", num_running=3), engine("e1"), engine("e2", num_running=1)]
    least = router(RouterMode.LEAST_LOADED)
    assert [least.route(engines, tokens(i), session_id="s").engine.engine_id
            for i in range(2)] == ["e1"] * 2
    turns = router(RouterMode.ROUND_ROBIN)
    assert [turns.route(engines, tokens(i), session_id="s").engine.engine_id
            for i in range(4)] == ["e0", "e1", "e2", "e0"]
    assert len(least.sessions) == len(turns.sessions) == 0


def test_sessions_expire_and_stay_bounded() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10.0, clock=lambda: now[0], max_entries=2)
    table.bind("a", "e0")
    table.bind("b", "e1")
    table.bind("c", "e0")
    assert table.get("a") is None and len(table) == 2    # least recently used dropped
    now[0] = 11.0
    assert table.get("b") is None


def test_a_new_session_goes_where_fewer_session_histories_are_held() -> None:
    kv = router()
    first = kv.route([engine("e0"), engine("e1")], tokens(30, 40 * BLOCK_SIZE), session_id="a")
    assert first.engine.engine_id == "e0"
    kv.settle(first)
    # Its turn is over; e1 now runs 5 blocks of something else. Load alone says e0, but
    # e0 holds a's 40-block history, which a's next turn will want back.
    engines = [engine("e0"), engine("e1", kv_cache_usage=0.005)]
    assert kv.route(engines, tokens(31), session_id="b").engine.engine_id == "e1"
    assert kv.sessions.num_blocks_on("e0") == 40 and kv.sessions.num_blocks_on("e1") == 8
    # A request of no session places by load alone.
    assert kv.route(engines, tokens(32)).engine.engine_id == "e0"


def test_the_history_weight_trades_held_sessions_against_a_cached_prefix() -> None:
    """e0 serves a conversation with a 10-block history and holds a 16-block system prompt
    (another request's); e1 serves one with a 1-block history. A new session with that
    prompt goes to e0 by cache alone, and with the histories counted once (10 - 1 < 16
    blocks saved); weighted 2 (they are still growing), it goes to e1."""
    system = tokens(40, 16 * BLOCK_SIZE)
    chosen = {}
    for weight in (0.0, 1.0, 2.0):
        kv = router(history_weight=weight)
        kv.index.apply("sched-e0", CLEARED)
        kv.index.apply("sched-e1", CLEARED)
        for session_id, seed, num_blocks in (("a", 41, 10), ("c", 43, 1)):
            kv.settle(kv.route([engine("e0"), engine("e1")],
                               tokens(seed, num_blocks * BLOCK_SIZE), session_id=session_id))
        assert kv.sessions.num_blocks_on("e0") == 10 and kv.sessions.num_blocks_on("e1") == 1
        kv.index.apply("sched-e0", stored(system))
        new = kv.route([engine("e0"), engine("e1")],
                       np.concatenate([system, tokens(42, 4 * BLOCK_SIZE)]), session_id="b")
        chosen[weight] = new.engine.engine_id
    assert chosen == {0.0: "e0", 1.0: "e0", 2.0: "e1"}


def test_new_sessions_split_evenly_whatever_the_momentary_load_and_cache() -> None:
    """Eight agents begin while e0 looks idle and holds their shared system prompt: by cost
    alone most would land on e0; they split four and four, and a session's later turns
    still stick."""
    kv = router()
    kv.index.apply("sched-e0", CLEARED)
    kv.index.apply("sched-e1", CLEARED)
    system = tokens(50, 32 * BLOCK_SIZE)
    kv.index.apply("sched-e0", stored(system))
    engines = [engine("e0"), engine("e1", kv_cache_usage=0.05)]
    placed = [kv.route(engines, np.concatenate([system, tokens(60 + i, 24 * BLOCK_SIZE)]),
                       session_id=f"agent-{i}").engine.engine_id for i in range(8)]
    assert sorted(placed) == ["e0"] * 4 + ["e1"] * 4
    assert (kv.sessions.num_sessions_on("e0"), kv.sessions.num_sessions_on("e1")) == (4, 4)
    later = kv.route(engines, tokens(70), session_id="agent-1")
    assert later.engine.engine_id == placed[1] and later.reason == "session"
    # An engine past the busy threshold takes no new session while another has room.
    busy = [engine("e0"), engine("e1", kv_cache_usage=0.95)]
    assert kv.route(busy, tokens(71), session_id="agent-8").engine.engine_id == "e0"


def test_session_histories_follow_their_sessions_and_expire() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10.0, clock=lambda: now[0])
    table.bind("a", "e0", 10)
    table.bind("b", "e0", 5)
    table.bind("a", "e1", 12)   # a spilled, with a longer history
    assert (table.num_blocks_on("e0"), table.num_blocks_on("e1")) == (5, 12)
    now[0] = 11.0
    table.bind("c", "e1", 3)
    assert (table.num_blocks_on("e0"), table.num_blocks_on("e1")) == (0, 3)
    assert len(table) == 1


def test_a_request_that_ended_stops_counting_before_the_next_heartbeat() -> None:
    now = [100.0]
    kv = router(wall_clock=lambda: now[0])
    history = tokens(14)                    # 8 blocks, held by e0
    kv.index.apply("sched-e0", stored(history))
    kv.index.apply("sched-e1", CLEARED)
    follow_up = np.concatenate([history, tokens(15, 40)])   # 11 blocks, 8 of them on e0
    # e0's last heartbeat still counts the turn that just ended there: 20 blocks.
    stale = [engine("e0", kv_cache_usage=0.02), engine("e1")]
    kv.settle(before := kv.route(stale, follow_up))
    assert before.engine.engine_id == "e1"                         # 3 + 20 > 11
    ended = kv.route([engine("e0"), engine("e1")], history)
    kv.release(ended, num_output_tokens=12 * BLOCK_SIZE)           # 8 + 12 blocks, at 100 s
    assert kv.route(stale, follow_up).engine.engine_id == "e0"     # 3 + 0 < 11
    # A report made before the release, arriving after it, still counts the request.
    kv.on_engine_heartbeat("e0", made_at=99.9)
    assert kv.route(stale, follow_up).engine.engine_id == "e0"
    kv.on_engine_heartbeat("e0", made_at=100.1)                    # a report that counts it
    assert kv.route(stale, follow_up).engine.engine_id == "e1"


def test_a_request_that_ended_within_a_heartbeat_stops_counting_as_waiting() -> None:
    kv = router()
    kv.index.apply("sched-e0", stored(history := tokens(14)))    # 8 blocks on e0
    kv.index.apply("sched-e1", CLEARED)
    follow_up = np.concatenate([history, tokens(15, 40)])       # 11 blocks, 8 of them on e0
    # e0's last report was made while a short request (8 prompt blocks) still waited there;
    # it ran and ended before the next one.
    stale = [dataclasses.replace(engine("e0"), num_waiting=1,
                                 num_waiting_tokens=8 * BLOCK_SIZE), engine("e1")]
    kv.settle(before := kv.route(stale, follow_up))
    assert before.engine.engine_id == "e1"           # 3 + 8 ties 11, and e1 is less loaded
    short = kv.route([engine("e0"), engine("e1")], tokens(16))
    kv.settle(short)
    kv.release(short, num_output_tokens=4, ended_on="e0")
    assert kv.route(stale, follow_up).engine.engine_id == "e0"          # 3 + 0 < 11


def test_a_request_moved_away_is_released_where_it_ended() -> None:
    kv = router()
    kv.index.apply("sched-e0", stored(history := tokens(14)))
    kv.index.apply("sched-e1", CLEARED)
    follow_up = np.concatenate([history, tokens(15, 40)])
    # Routed to e1, moved off its queue to e0, which still reports it running.
    moved = kv.route([engine("e0", kv_cache_usage=0.5), engine("e1")], tokens(16))
    assert moved.engine.engine_id == "e1"
    stale = [engine("e0", kv_cache_usage=0.02), engine("e1")]
    kv.release(moved, num_output_tokens=12 * BLOCK_SIZE, ended_on="e0")
    assert kv.route(stale, follow_up).engine.engine_id == "e0"


def test_a_release_stops_counting_past_its_age_whatever_the_schedulers_clock() -> None:
    now = [100.0]
    kv = router(wall_clock=lambda: now[0])
    kv.index.apply("sched-e0", stored(history := tokens(14)))
    kv.index.apply("sched-e1", CLEARED)
    follow_up = np.concatenate([history, tokens(15, 40)])
    stale = [engine("e0", kv_cache_usage=0.02), engine("e1")]
    kv.release(kv.route([engine("e0"), engine("e1")], history), num_output_tokens=12 * BLOCK_SIZE)
    now[0] += RELEASE_MAX_AGE_S / 2
    kv.on_engine_heartbeat("e0", made_at=50.0)        # a scheduler clock far behind
    assert kv.route(stale, follow_up).engine.engine_id == "e0"
    now[0] += RELEASE_MAX_AGE_S
    kv.on_engine_heartbeat("e0", made_at=50.0)
    assert kv.route(stale, follow_up).engine.engine_id == "e1"
