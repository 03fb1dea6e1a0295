"""Faults under load, against the real mesh: SIGKILL of each service and a NATS restart
while streams run. Every stream ends within a bounded time — with its full answer (greedy:
identical to an undisturbed run) or a clear retriable error — and the broken service
rejoins without the others restarting."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.faults.conftest import (ENGINES, bodies, busiest_engine, complete, gateway_metric,
                                   health, metric, record, wait_idle, wait_whole)
from tests.faults.streams import StreamSet, poll, post_json
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

# A stream must end this long after the fault at the latest (detection 3.5-5 s, a restart,
# a re-prefill and the rest of the tokens on a loaded 2-core machine).
RECOVERY_BOUND_S = 120.0


def pids(mesh: Mesh) -> dict[str, int]:
    return {name: s.process.pid for name, s in mesh.services.items() if s.process is not None}


def resumed_after(results, moment: float) -> float:  # noqa: ANN001
    """Seconds from `moment` to the first chunk any stream got after it."""
    later = [t for r in results for t in r.chunk_times if t > moment]
    return (min(later) - moment) if later else float("nan")


def test_worker_killed_mid_generation_resumes_on_the_restarted_worker(
        fault_mesh: Mesh, reference: list[str]) -> None:
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    scheduler, worker = busiest_engine(fault_mesh)
    others = {k: v for k, v in pids(fault_mesh).items() if k != worker}
    preemptions = metric(fault_mesh, scheduler, "vllm:num_preemptions_total")
    killed = time.monotonic()
    fault_mesh.restart(worker)             # SIGKILL, then start again as compose would
    results = streams.finish(RECOVERY_BOUND_S)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference      # the streams simply continued
    # The engine's requests were preempted back to waiting and resumed on the new worker.
    assert metric(fault_mesh, scheduler, "vllm:num_preemptions_total") > preemptions
    wait_whole(fault_mesh)
    assert {k: v for k, v in pids(fault_mesh).items() if k != worker} == others
    record("worker SIGKILL + restart", client_saw="streams paused, then completed identically",
           resumed_after_s=resumed_after(results, killed),
           longest_gap_s=max(r.longest_gap_s for r in results),
           all_done_after_s=max(r.ended for r in results) - killed,
           mesh_whole_after_s=time.monotonic() - killed)


def test_requests_for_a_just_killed_engine_go_to_a_live_one(fault_mesh: Mesh) -> None:
    """Killed while idle: the gateway still believes engine-0 alive (its heartbeat is not
    stale yet) and, with both idle, picks it first; the submit finds nobody there and goes
    to engine-1."""
    poll(lambda: all(gateway_metric(fault_mesh, "vllm:num_requests_running", engine=e) == 0
                     for e in ENGINES), 30, "the gateway to see both engines idle")
    fault_mesh.services["scheduler"].stop(signal.SIGKILL)
    killed = time.monotonic()
    statuses = [post_json(f"{fault_mesh.base_url}/v1/completions",
                          {"model": "SmolLM2-135M-Instruct", "prompt": f"Count to {i}:",
                           "max_tokens": 4, "temperature": 0})[0] for i in range(3)]
    answered = time.monotonic() - killed
    assert statuses == [200, 200, 200]
    failovers = [json.loads(line) for line in
                 fault_mesh.services["gateway"].log_path.read_text().splitlines()
                 if "submitting to another" in line]
    assert failovers and failovers[-1]["engine"] == "engine-0"
    assert failovers[-1]["code"] == "engine_unavailable"
    fault_mesh.restart("scheduler")
    rejoined = wait_whole(fault_mesh)
    record("scheduler SIGKILL while idle", client_saw="200 for requests sent at once",
           answered_within_s=answered, rejoined_after_s=rejoined)


def test_scheduler_killed_mid_generation_moves_requests_to_the_other_engine(
        fault_mesh: Mesh, reference: list[str]) -> None:
    moved = gateway_metric(fault_mesh, "llm_mesh:request_migrations_total", outcome="moved")
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    scheduler, _ = busiest_engine(fault_mesh)
    survivor = "scheduler-1" if scheduler == "scheduler" else "scheduler"
    others = {k: v for k, v in pids(fault_mesh).items() if k != scheduler}
    num_held = metric(fault_mesh, scheduler, "vllm:num_requests_running")
    finished_on_survivor = metric(fault_mesh, survivor, "vllm:request_success_total")
    fault_mesh.services[scheduler].stop(signal.SIGKILL)     # that engine is gone
    killed = time.monotonic()
    results = streams.finish(RECOVERY_BOUND_S)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference      # no duplicated or missing text
    num_moved = gateway_metric(fault_mesh, "llm_mesh:request_migrations_total",
                               outcome="moved") - moved
    assert num_moved >= num_held >= 1
    assert metric(fault_mesh, survivor, "vllm:request_success_total") \
        - finished_on_survivor >= num_held
    fault_mesh.restart(scheduler)
    # The restarted scheduler rejoins; its worker (never restarted) serves it again.
    rejoined = wait_whole(fault_mesh)
    assert {k: v for k, v in pids(fault_mesh).items() if k != scheduler} == others
    generated = metric(fault_mesh, scheduler, "vllm:generation_tokens_total")

    def served_by_rejoined_engine() -> bool:
        # Two at once on idle engines: the second sees the first's prompt pending on one
        # engine and goes to the other (a lone short prompt ties, and ties go to engine-0,
        # which may not be the rejoined one); a router that never picks it again fails here.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: complete(fault_mesh, "Engine is back", 16), range(2)))
        return metric(fault_mesh, scheduler, "vllm:generation_tokens_total") > generated
    poll(served_by_rejoined_engine, 60, f"the rejoined {scheduler} to serve a request",
         interval_s=0)
    record("scheduler SIGKILL mid-generation (two engines)",
           client_saw="streams paused, then continued on engine-1, identical",
           moved=num_moved, resumed_after_s=resumed_after(results, killed),
           longest_gap_s=max(r.longest_gap_s for r in results),
           all_done_after_s=max(r.ended for r in results) - killed, rejoined_after_s=rejoined)


def test_tokenizer_killed_mid_generation(fault_mesh: Mesh, reference: list[str]) -> None:
    others = {k: v for k, v in pids(fault_mesh).items() if k != "tokenizer"}
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    fault_mesh.services["tokenizer"].stop(signal.SIGKILL)
    killed = time.monotonic()
    # A request that starts while no tokenizer runs gets a retriable 503 at once.
    status, headers, body = post_json(f"{fault_mesh.base_url}/v1/completions",
                                      bodies(4)[0])
    refused_after = time.monotonic() - killed
    assert status == 503 and body["error"]["code"] == "tokenizer_unavailable", body
    assert int(headers["retry-after"]) >= 1 and refused_after < 5
    fault_mesh.services["tokenizer"].start({**os.environ, "PYTHONUNBUFFERED": "1"})
    results = streams.finish(RECOVERY_BOUND_S)
    # Their detokenizer state died with the tokenizer: each moved to the restarted one,
    # which resumed decoding after the text the client already had.
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference
    rejoined = wait_whole(fault_mesh)
    assert {k: v for k, v in pids(fault_mesh).items() if k != "tokenizer"} == others
    idle_after = wait_idle(fault_mesh, 30, "the engines to be idle")
    record("tokenizer SIGKILL mid-generation, restarted",
           client_saw="new requests: 503 + Retry-After; running streams paused, then "
                      "completed identically", refused_after_s=refused_after,
           resumed_after_s=resumed_after(results, killed),
           all_done_after_s=max(r.ended for r in results) - killed, rejoined_after_s=rejoined,
           engines_idle_after_s=idle_after)


def test_tokenizer_stopped_with_sigterm_finishes_its_streams_first(
        fault_mesh: Mesh, reference: list[str]) -> None:
    moved = gateway_metric(fault_mesh, "llm_mesh:request_migrations_total", outcome="moved")
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    stopped = time.monotonic()
    # Blocks until the tokenizer exits: it drains first (streams still running here).
    assert fault_mesh.services["tokenizer"].stop(signal.SIGTERM) == 0
    results = streams.finish(RECOVERY_BOUND_S)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference
    # Drained, not moved: it held running requests when it stopped, and every stream ended
    # on it (a request left over would have moved to the restarted tokenizer).
    held = [json.loads(line)["count"] for line in
            fault_mesh.services["tokenizer"].log_path.read_text().splitlines()
            if "finishing the requests held here" in line]
    assert held and held[-1] >= 1
    assert gateway_metric(fault_mesh, "llm_mesh:request_migrations_total",
                          outcome="moved") == moved
    fault_mesh.services["tokenizer"].start({**os.environ, "PYTHONUNBUFFERED": "1"})
    rejoined = wait_whole(fault_mesh)
    record("tokenizer SIGTERM mid-generation", client_saw="streams completed on it (drain)",
           stopped_after_s=time.monotonic() - stopped, rejoined_after_s=rejoined)


def test_nats_restart_mid_generation(fault_mesh: Mesh, reference: list[str]) -> None:
    before = pids(fault_mesh)
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    restarted = time.monotonic()
    fault_mesh.restart_nats()      # stop nats-server, start it on the same port
    results = streams.finish(RECOVERY_BOUND_S)
    # Messages in flight during the restart are lost; requests that spanned it are moved
    # (continued from what the gateway received), so each still ends whole.
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference
    reconnected = wait_whole(fault_mesh)
    assert pids(fault_mesh) == before            # every service reconnected by itself
    idle_after = wait_idle(fault_mesh, 60, "the engines to be idle")
    assert complete(fault_mesh, "After the restart", 4)["usage"]["completion_tokens"] == 4
    record("nats-server restart mid-generation",
           client_saw="streams paused, then completed identically",
           resumed_after_s=resumed_after(results, restarted),
           all_done_after_s=max(r.ended for r in results) - restarted,
           mesh_ready_after_s=reconnected, engines_idle_after_s=idle_after)


def test_gateway_killed_mid_generation(fault_mesh: Mesh) -> None:
    others = {k: v for k, v in pids(fault_mesh).items() if k != "gateway"}
    long = bodies(1500)       # far longer than the test: only an abort can end them early
    streams = StreamSet(fault_mesh.base_url, long)
    streams.wait_for_chunks(3)
    killed = time.monotonic()
    fault_mesh.services["gateway"].stop(signal.SIGKILL)
    results = streams.finish(30)
    # Nobody is left to send an error: each client sees its connection break, at once.
    assert all(r.transport_error and not r.completed for r in results), \
        [r.outcome() for r in results]
    broken_after = max(r.ended for r in results) - killed
    assert broken_after < 5
    # Tokenizers drop a gone gateway's requests; the engines abort them and free blocks.
    idle_after = wait_idle(fault_mesh, 30, "the engines to drop the requests")
    fault_mesh.services["gateway"].start({**os.environ, "PYTHONUNBUFFERED": "1"})
    rejoined = wait_whole(fault_mesh)
    assert {k: v for k, v in pids(fault_mesh).items() if k != "gateway"} == others
    assert complete(fault_mesh, "A new gateway", 4)["usage"]["completion_tokens"] == 4
    assert health(fault_mesh)["scheduler"] == "2 ready"
    record("gateway SIGKILL mid-generation", client_saw=results[0].outcome(),
           broken_after_s=broken_after, engines_idle_after_s=idle_after,
           rejoined_after_s=rejoined)
