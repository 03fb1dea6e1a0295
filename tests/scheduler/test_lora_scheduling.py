"""Multi-LoRA in the scheduler: no step mixes more adapters than the worker's slots
(max_loras); a request whose adapter must wait keeps its place while others of running
adapters (and the base) go ahead; an engine without LoRA refuses adapter requests; a request
the worker rejects mid-prefill (its adapter would not load) ends at once with its reason."""

from __future__ import annotations

import pytest

from services.scheduler.core import RequestStatus, RunnerOutput
from tests.scheduler.fakes import Run, make_request, make_scheduler, reference_output, step


def _request(request_id: str, lora_id: int, length: int = 6, max_tokens: int = 5):
    prompt = [lora_id * 10 + i + 1 for i in range(length)]
    return make_request(request_id, prompt, max_tokens, lora_id=lora_id,
                        lora=f"adapter {lora_id}" if lora_id else None)


def test_no_step_mixes_more_adapters_than_max_loras() -> None:
    scheduler, worker = make_scheduler(max_loras=2, max_cpu_loras=3)
    requests = [_request(f"r{i}", lora_id) for i, lora_id in
                enumerate([1, 2, 3, 1, 0, 3, 2, 0])]
    for request in requests:
        scheduler.add_request(request)
    lora_of = {r.request_id: r.lora_id for r in requests}
    run = Run()
    adapters_per_step = []
    while scheduler.has_unfinished_requests():
        out = step(scheduler, worker, run)
        adapters_per_step.append({lora_of[rid] for rid in out.request_ids} - {0})
    assert max(len(ids) for ids in adapters_per_step) == 2
    assert any(3 in ids for ids in adapters_per_step)
    for request in requests:
        assert run.outputs[request.request_id] == reference_output(request.prompt_token_ids, 5)
    # The first step: adapters 1 and 2 and the base start; 3 waits, base r4 does not.
    first = run.steps[0]
    assert set(first.request_ids) == {"r0", "r1", "r3", "r4", "r6", "r7"}
    # New requests carried their adapter to the worker; the held list follows use.
    assert {n.lora for n in first.new_requests} == {"adapter 1", "adapter 2", None}
    assert scheduler.loras is not None and sorted(scheduler.loras.held) == [1, 2, 3]


def test_an_engine_without_lora_refuses_adapter_requests() -> None:
    scheduler, _ = make_scheduler()
    with pytest.raises(ValueError, match="--enable-lora"):
        scheduler.add_request(_request("r0", 1))


def test_a_request_rejected_mid_prefill_ends_with_the_reason() -> None:
    scheduler, _ = make_scheduler(max_loras=1, max_num_batched_tokens=4)
    request = _request("r0", 1, length=10)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [4]   # a chunk: nothing sampled this step
    [result] = scheduler.update_from_output(
        out, RunnerOutput([], [], rejected={request.handle: "adapter 1 could not be loaded"}))
    assert result.finish_reason is not None and request.status is RequestStatus.FINISHED_ERROR
    assert request.error == "adapter 1 could not be loaded"
    assert request.error_code == "invalid_request"
    assert not scheduler.has_unfinished_requests()
