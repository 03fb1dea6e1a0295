"""A job from its record to its files, against real JetStream and a fake engine: input
order, malformed lines, exactly once per custom_id across a killed run, two runners at once,
a drain, a cancel, and the owner's tenant."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from services.batch.job_runner import JobRunner
from services.batch.line_executor import LineOutcome
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.batch_jobs.records import BatchJob, BatchRecord, FileRecord
from services.frontend.tenancy.auth import ApiKeys, Tenant, key_id

CHAT = "/v1/chat/completions"


class FakeExecutor:
    """Answers a line after `delay_s`; a body with "status" answers that error status. With
    `hold_after`, lines past that many wait until the runner is told to stop, then end
    without a result (as a line cut short by a cancel does)."""

    def __init__(self, delay_s: float = 0.0, hold_after: int | None = None) -> None:
        self.delay_s = delay_s
        self.hold_after = hold_after
        self.ran: list[str] = []
        self.tenants: set[Tenant | None] = set()   # what its lines ran as

    async def run(self, endpoint: str, body: dict[str, Any], tenant: Tenant | None,
                  should_stop: Callable[[], bool]) -> LineOutcome | None:
        self.tenants.add(tenant)
        await asyncio.sleep(self.delay_s)
        if self.hold_after is not None and len(self.ran) >= self.hold_after:
            while not should_stop():
                await asyncio.sleep(0.01)
            return None
        self.ran.append(body["tag"])
        if "status" in body:
            return LineOutcome(body["status"], "", {"error": {"message": "refused"}})
        return LineOutcome(200, f"chatcmpl-{body['tag']}", {
            "object": "chat.completion", "tag": body["tag"],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def runner(store: BatchStore, executor: FakeExecutor, max_concurrent_lines: int,
           api_keys: ApiKeys | None = None) -> JobRunner:
    """A runner in the open mesh (no API keys) unless `api_keys` says otherwise."""
    return JobRunner(store, executor, max_concurrent_lines, api_keys or ApiKeys([]))


def request_line(custom_id: str, **body: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"tag": custom_id, **body}}).encode()


async def submit(store: BatchStore, lines: list[bytes], batch_id: str = "batch_t",
                 owner: str = "") -> BatchJob:
    await store.put_file(FileRecord(id="file-in", filename="in.jsonl", purpose="batch",
                                    owner=owner), b"\n".join(lines) + b"\n")
    return BatchJob(batch_id=batch_id, input_file_id="file-in", endpoint=CHAT, owner=owner)


async def finished_record(store: BatchStore, batch_id: str = "batch_t") -> BatchRecord:
    record = await store.record(batch_id)
    assert record is not None
    return record


async def file_entries(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = await store.file_content(file_id)
    assert data is not None
    return [json.loads(line) for line in data.splitlines()]


async def wait_for_results(store: BatchStore, count: int, batch_id: str = "batch_t") -> None:
    while len(await store.results(batch_id)) < count:
        await asyncio.sleep(0.01)


async def test_job_writes_output_and_error_files_in_input_order(store: BatchStore) -> None:
    lines = [request_line(f"r{i}") for i in range(10)]
    lines[3:3] = [b"{broken", request_line("refused", status=400), request_line("r0")]
    job = await submit(store, lines)
    assert await runner(store, FakeExecutor(), 4).run(job, asyncio.Event())
    record = await finished_record(store)
    assert record.status == "completed" and record.completed_at is not None
    assert record.request_counts.model_dump() == {"total": 13, "completed": 10, "failed": 3}
    assert (record.usage.input_tokens, record.usage.output_tokens) == (30, 20)
    outputs = await file_entries(store, record.output_file_id)
    assert [e["custom_id"] for e in outputs] == [f"r{i}" for i in range(10)]
    assert all(e["response"]["body"]["tag"] == e["custom_id"] for e in outputs)
    errors = await file_entries(store, record.error_file_id)
    assert [(e["custom_id"], e["error"] and e["error"]["code"]) for e in errors] == [
        (None, "invalid_json"), ("refused", None), ("r0", "duplicate_custom_id")]
    assert errors[1]["response"]["status_code"] == 400
    output_file = await store.file_record(record.output_file_id or "")
    assert output_file is not None and output_file.purpose == "batch_output"


async def test_a_killed_run_resumes_with_every_line_exactly_once(store: BatchStore) -> None:
    job = await submit(store, [request_line(f"r{i}") for i in range(40)])
    first = FakeExecutor(delay_s=0.01)
    killed = asyncio.create_task(runner(store, first, 4).run(job, asyncio.Event()))
    await wait_for_results(store, 10)
    killed.cancel()  # like SIGKILL: lines in flight end without a result
    with contextlib.suppress(asyncio.CancelledError):
        await killed
    done_before = set((await store.results("batch_t")).keys())
    second = FakeExecutor()
    assert await runner(store, second, 4).run(job, asyncio.Event())
    record = await finished_record(store)
    outputs = await file_entries(store, record.output_file_id)
    assert sorted(e["custom_id"] for e in outputs) == sorted(f"r{i}" for i in range(40))
    assert record.request_counts.completed == 40
    assert len(done_before) >= 10 and len(second.ran) == 40 - len(done_before)
    assert len(first.ran) + len(second.ran) <= 40 + 4  # at most the lines in flight re-ran


async def test_two_runners_on_one_job_write_each_line_once(store: BatchStore) -> None:
    job = await submit(store, [request_line(f"r{i}") for i in range(20)])
    runs = [runner(store, FakeExecutor(delay_s=0.005), 3).run(job, asyncio.Event())
            for _ in range(2)]
    assert await asyncio.gather(*runs) == [True, True]
    record = await finished_record(store)
    outputs = await file_entries(store, record.output_file_id)
    assert sorted(e["custom_id"] for e in outputs) == sorted(f"r{i}" for i in range(20))


async def test_a_drained_run_hands_the_job_back(store: BatchStore) -> None:
    job = await submit(store, [request_line(f"r{i}") for i in range(30)])
    stop = asyncio.Event()
    running = asyncio.create_task(runner(store, FakeExecutor(delay_s=0.01), 2).run(job, stop))
    await wait_for_results(store, 4)
    stop.set()
    assert not await running
    record = await finished_record(store)
    assert record.status == "in_progress" and 4 <= record.request_counts.completed < 30
    assert await runner(store, FakeExecutor(), 2).run(job, asyncio.Event())
    assert (await finished_record(store)).request_counts.completed == 30


async def test_cancel_stops_new_lines_and_keeps_finished_ones(store: BatchStore) -> None:
    job = await submit(store, [request_line(f"r{i}") for i in range(200)])
    running = asyncio.create_task(
        runner(store, FakeExecutor(delay_s=0.01, hold_after=5), 2).run(job, asyncio.Event()))
    await wait_for_results(store, 5)
    await store.update_record("batch_t", lambda r: setattr(r, "status", "cancelling"))
    assert await running
    record = await finished_record(store)
    assert record.status == "cancelled" and record.cancelled_at is not None
    outputs = await file_entries(store, record.output_file_id)
    assert len(outputs) == record.request_counts.completed == 5
    assert len({e["custom_id"] for e in outputs}) == len(outputs)


async def test_a_finished_job_delivered_again_runs_nothing(store: BatchStore) -> None:
    job = await submit(store, [request_line("r0")])
    assert await runner(store, FakeExecutor(), 1).run(job, asyncio.Event())
    again = FakeExecutor()
    assert await runner(store, again, 1).run(job, asyncio.Event())
    assert again.ran == []


async def test_a_job_without_its_input_file_fails(store: BatchStore) -> None:
    job = BatchJob(batch_id="batch_t", input_file_id="file-missing", endpoint=CHAT)
    assert await runner(store, FakeExecutor(), 1).run(job, asyncio.Event())
    record = await finished_record(store)
    assert record.status == "failed" and record.errors is not None
    assert record.errors.data[0].code == "invalid_input_file"


async def test_lines_run_as_the_owner_whose_files_the_outputs_are(store: BatchStore) -> None:
    keys = ApiKeys(["alpha-key", "beta-key"])
    alpha = keys.identify("Bearer alpha-key")
    assert alpha is not None
    job = await submit(store, [request_line("r0"), b"{broken"], owner=alpha.key_id)
    executor = FakeExecutor()
    assert await runner(store, executor, 2, keys).run(job, asyncio.Event())
    record = await finished_record(store)
    assert record.status == "completed" and record.owner == alpha.key_id
    assert executor.tenants == {alpha}
    for file_id in (record.output_file_id, record.error_file_id):
        file = await store.file_record(file_id or "")
        assert file is not None and file.owner == alpha.key_id


async def test_a_job_sent_over_nats_without_an_owner_runs_with_no_tenant(
        store: BatchStore) -> None:
    job = await submit(store, [request_line("r0")])
    executor = FakeExecutor()
    assert await runner(store, executor, 1, ApiKeys(["alpha-key"])).run(job, asyncio.Event())
    assert (await finished_record(store)).status == "completed"
    assert executor.tenants == {None}


async def test_a_batch_of_a_key_the_runner_does_not_accept_fails(store: BatchStore) -> None:
    owner = key_id("revoked-key")
    # A key since revoked, and a runner not given the gateway's keys: never run unsalted.
    for batch_id, keys in (("batch_revoked", ApiKeys(["alpha-key"])), ("batch_open", None)):
        job = await submit(store, [request_line("r0")], batch_id, owner=owner)
        executor = FakeExecutor()
        assert await runner(store, executor, 1, keys).run(job, asyncio.Event())
        record = await finished_record(store, batch_id)
        assert record.status == "failed" and record.errors is not None
        assert record.errors.data[0].code == "invalid_api_key" and executor.ran == []
