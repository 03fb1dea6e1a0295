"""Hangs, not only deaths: a service stopped with SIGSTOP (alive to the kernel, silent to the
mesh), then woken with SIGCONT while streams run.

- A worker that hangs where its scheduler cannot tell (its worker timeouts far away): only
  the gateway's stall watchdog ends the wait. The streams get keep-alive comments while
  they wait, then move to the other engine, within the documented bound.
- A scheduler that hangs: the gateway forgets it and moves its requests; when it wakes it
  still holds them and steps them, but that output reaches no client (every move gives the
  request a new id) and the requests are dropped there.
- A worker that hangs past its scheduler's heartbeat timeout: its requests are preempted;
  when it wakes with the same incarnation the scheduler resets its rows and they resume.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from tests.faults.conftest import (MIGRATION_TIMEOUT_S, PROMPTS, STALL_TIMEOUT_S, bodies,
                                   busiest_engine, complete, gateway_metric, metric, record,
                                   wait_idle, wait_whole)
from tests.faults.streams import StreamResult, StreamSet, poll
from tests.mesh import Mesh, ServiceProcess

pytestmark = pytest.mark.slow

# The documented bound, with room for the re-prefill on a loaded 2-core machine.
END_BOUND_S = STALL_TIMEOUT_S + MIGRATION_TIMEOUT_S + 5.0
LONG_TOKENS = 200       # still streaming on the other engine when a stopped service wakes
BLIND = ["--worker-heartbeat-timeout-s", "600", "--worker-step-timeout-s", "600"]


@pytest.fixture(scope="module")
def long_reference(fault_mesh: Mesh) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(fault_mesh, p, LONG_TOKENS)["choices"][0]
                             ["text"], PROMPTS))


def restart_with(mesh: Mesh, service: ServiceProcess, argv: list[str]) -> None:
    service.stop(signal.SIGTERM)
    service.argv = argv
    service.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_whole(mesh)


@contextmanager
def blind_scheduler(mesh: Mesh) -> Iterator[None]:
    """engine-0's scheduler restarted deaf to its worker's silence: a hang of that worker
    is invisible to it (it waits for the step's reply), so no worker loss, no rejoin path."""
    service = mesh.services["scheduler"]
    normal = list(service.argv)
    restart_with(mesh, service, normal + BLIND)
    try:
        yield
    finally:
        restart_with(mesh, service, normal)


@contextmanager
def stopped(service: ServiceProcess) -> Iterator[float]:
    """SIGSTOP now (yields when), SIGCONT on leaving, whatever happened."""
    assert service.process is not None
    service.process.send_signal(signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        service.process.send_signal(signal.SIGCONT)


def silence_s(result: StreamResult) -> tuple[float, float]:
    """A stream's longest silence, to a chunk or to its end: (start, seconds)."""
    times = [result.started, *result.chunk_times, result.ended or time.monotonic()]
    start, end = max(zip(times, times[1:]), key=lambda gap: gap[1] - gap[0])
    return start, end - start


def gateway_log(mesh: Mesh, event: str) -> list[dict]:
    return [json.loads(line) for line in
            mesh.services["gateway"].log_path.read_text().splitlines()
            if f'"{event}"' in line]


def test_a_hung_worker_is_found_by_the_gateway_watchdog(
        fault_mesh: Mesh, reference: list[str]) -> None:
    with blind_scheduler(fault_mesh):
        stalls = gateway_metric(fault_mesh, "llm_mesh:request_stalls_total")
        num_logged = len(gateway_log(fault_mesh, "request stalled; moving it"))
        streams = StreamSet(fault_mesh.base_url, bodies())
        streams.wait_for_chunks(3)
        num_held = metric(fault_mesh, "scheduler", "vllm:num_requests_running")
        with stopped(fault_mesh.services["worker"]) as hung:
            results = streams.finish(END_BOUND_S + 60)
        # Moved to engine-1 and continued there: identical, nothing lost or repeated.
        assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
        assert [r.text for r in results] == reference
        silences = [silence_s(r) for r in results]
        assert max(s for _, s in silences) <= END_BOUND_S, silences
        # The streams that waited heard keep-alives (one a second) all along the wait.
        waited = [(r, start, s) for r, (start, s) in zip(results, silences)
                  if s >= STALL_TIMEOUT_S]
        assert len(waited) >= num_held >= 1, silences
        assert all(r.keepalives_between(start, start + s) >= s / 2 for r, start, s in waited)
        stalled = gateway_log(fault_mesh, "request stalled; moving it")[num_logged:]
        assert len(stalled) >= num_held and {s["engine"] for s in stalled} == {"engine-0"}
        assert all(s["silent_s"] >= STALL_TIMEOUT_S for s in stalled)
        assert gateway_metric(fault_mesh, "llm_mesh:request_stalls_total") - stalls \
            == len(stalled)
        stalled_ids = {s["request_id"] for s in stalled}
        moves = [m for m in gateway_log(fault_mesh, "request moved")
                 if m["request_id"] in stalled_ids]
        assert len(moves) == len(stalled)        # not back onto the hung engine-0
        assert all(m["reason"] == "engine stalled" and m["to_engine"] == "engine-1"
                   for m in moves), moves
        # Awake again: its stuck step ends, its moved requests are dropped there.
        idle_after = wait_idle(fault_mesh, 60, "the engines to be idle")
    record("worker SIGSTOP, its scheduler blind to it (gateway watchdog)",
           client_saw="keep-alives, then the streams continued on engine-1, identical",
           stalled=len(stalled), longest_silence_s=max(s for _, s in silences),
           all_done_after_s=max(r.ended for r in results) - hung,
           keepalives=sum(r.keepalives_between(st, st + s) for r, st, s in waited),
           engines_idle_after_wake_s=idle_after)


def test_a_scheduler_that_hangs_then_wakes_writes_into_no_moved_stream(
        fault_mesh: Mesh, long_reference: list[str]) -> None:
    moved = gateway_metric(fault_mesh, "llm_mesh:request_migrations_total", outcome="moved")
    streams = StreamSet(fault_mesh.base_url, bodies(LONG_TOKENS))
    streams.wait_for_chunks(3)
    scheduler, _ = busiest_engine(fault_mesh)
    num_held = metric(fault_mesh, scheduler, "vllm:num_requests_running")
    generated = metric(fault_mesh, scheduler, "vllm:generation_tokens_total")
    with stopped(fault_mesh.services[scheduler]) as hung:
        # Past --instance-timeout-s the gateway forgets it and moves its requests.
        poll(lambda: gateway_metric(fault_mesh, "llm_mesh:request_migrations_total",
                                    outcome="moved") - moved >= num_held, 60,
             "the gateway to move the stopped scheduler's requests")
        # Woken while the moved streams still run on the other engine.
    woke = time.monotonic()
    results = streams.finish(120)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == long_reference     # nothing repeated, nothing lost
    assert max(r.ended for r in results) > woke + 1         # it woke mid-stream
    # It still held the moved requests: they are dropped there, their blocks freed.
    idle_after = wait_idle(fault_mesh, 60, "the woken engine to drop them")
    rejoined = wait_whole(fault_mesh)
    record("scheduler SIGSTOP, woken mid-stream",
           client_saw="streams paused, continued on the other engine, identical",
           moved_after_s=woke - hung, all_done_after_wake_s=max(r.ended for r in results) - woke,
           stale_tokens_generated=metric(fault_mesh, scheduler, "vllm:generation_tokens_total")
           - generated, engines_idle_after_wake_s=idle_after, rejoined_after_s=rejoined)


def test_a_worker_that_hangs_past_its_heartbeat_timeout_resumes_on_waking(
        fault_mesh: Mesh, reference: list[str]) -> None:
    moved = gateway_metric(fault_mesh, "llm_mesh:request_migrations_total", outcome="moved")
    streams = StreamSet(fault_mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    scheduler, worker = busiest_engine(fault_mesh)
    log = fault_mesh.services[scheduler].log_path
    num_lost = log.read_text().count("worker lost; its requests wait for it")
    preemptions = metric(fault_mesh, scheduler, "vllm:num_preemptions_total")
    with stopped(fault_mesh.services[worker]) as hung:
        poll(lambda: log.read_text().count("worker lost; its requests wait for it")
             > num_lost, 30, "the scheduler to declare its worker lost")
        lost_after = time.monotonic() - hung
    # Same incarnation: the step it answers on waking was given up (its reply is dropped),
    # and the next step resets its rows before the preempted requests resume there.
    results = streams.finish(120)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference
    assert metric(fault_mesh, scheduler, "vllm:num_preemptions_total") > preemptions
    assert gateway_metric(fault_mesh, "llm_mesh:request_migrations_total",
                          outcome="moved") == moved      # resumed where they were
    wait_whole(fault_mesh)
    record("worker SIGSTOP past its heartbeat timeout, then SIGCONT",
           client_saw="streams paused, then resumed on the same engine, identical",
           lost_after_s=lost_after, longest_gap_s=max(r.longest_gap_s for r in results),
           all_done_after_s=max(r.ended for r in results) - hung)
