"""Runs one batch job from its record to its output and error files.

A job may have run before (its runner was killed, or drained): the results already stored
are its progress, and only lines without one run now. Every line's result is stored with
create-if-absent before it counts, so a line is in the output exactly once however often the
job is redelivered. Cancelling stops new lines; lines in flight finish and are kept.

Lines run as the batch's owner (the tenant of the API key that created it: its prefix-cache
salt and token bucket), and the output and error files belong to that owner. A batch whose
owner is not a key this runner accepts fails rather than running unsalted and unlimited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass

import structlog

from services.batch.input_file import (
    BatchLine,
    MalformedLine,
    error_entry,
    is_success,
    parse_input,
    response_entry,
)
from services.batch.line_executor import LineExecutor, LineOutcome
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.batch_jobs.records import (
    BATCH_ENDPOINTS,
    BatchJob,
    BatchRecord,
    FileRecord,
    error_file_id,
    output_file_id,
)
from services.frontend.tenancy.auth import ApiKeys, Tenant

log = structlog.get_logger(__name__)

PROGRESS_INTERVAL_S = 0.5


@dataclass
class Progress:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, entry: bytes) -> None:
        parsed = json.loads(entry)
        if not is_success(parsed):
            self.failed += 1
            return
        self.completed += 1
        usage = parsed["response"]["body"].get("usage") or {}
        self.input_tokens += usage.get("prompt_tokens", 0)
        self.output_tokens += usage.get("completion_tokens", 0)

    def apply(self, record: BatchRecord) -> None:
        record.request_counts.completed = self.completed
        record.request_counts.failed = self.failed
        record.usage.input_tokens = self.input_tokens
        record.usage.output_tokens = self.output_tokens
        record.usage.total_tokens = self.input_tokens + self.output_tokens


class JobRunner:
    def __init__(self, store: BatchStore, executor: LineExecutor, max_concurrent_lines: int,
                 api_keys: ApiKeys) -> None:
        self._store = store
        self._executor = executor
        self._max_concurrent_lines = max_concurrent_lines
        self._api_keys = api_keys

    async def run(self, job: BatchJob, stop: asyncio.Event) -> bool:
        """Runs the job; True once it reached a final status, False when `stop` (drain)
        interrupted it and it should run again elsewhere."""
        record = await self._store.create_record(BatchRecord.from_job(job))
        if record.is_terminal:
            return True
        # NOTE: "" (no owner) in a mesh with keys is a job sent over NATS without one: it
        # runs with no tenant, as NATS users are trusted with the whole mesh anyway.
        tenant = self._api_keys.by_key_id(record.owner)
        if tenant is None and record.owner:
            await self._fail(record, "invalid_api_key", "the API key that created this batch "
                             "is not accepted by the batch runner (revoked, or the runner "
                             "lacks the gateway's --api-key)")
            return True
        lines = await self._load_lines(record)
        if lines is None:
            return True
        return await _JobRun(self._store, self._executor, record, tenant, lines, stop).run(
            self._max_concurrent_lines)

    async def _load_lines(self, record: BatchRecord) -> list[BatchLine | MalformedLine] | None:
        """The job's lines, or None after failing the job for a bad input file or endpoint."""
        data = await self._store.file_content(record.input_file_id)
        if record.endpoint not in BATCH_ENDPOINTS:
            problem = ("invalid_endpoint", f"endpoint {record.endpoint} is not supported; use "
                                           f"one of {', '.join(BATCH_ENDPOINTS)}")
        elif data is None:
            problem = ("invalid_input_file", f"input file {record.input_file_id} not found")
        elif not (lines := parse_input(data, record.endpoint)):
            problem = ("empty_file", f"input file {record.input_file_id} has no requests")
        else:
            return lines
        await self._fail(record, *problem)
        return None

    async def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        await self._store.update_record(record.id, lambda r: r.fail(code, message))
        log.warning("batch failed", batch_id=record.id, reason=message)


class _JobRun:
    """One attempt at a job: run its pending lines, keep the record's progress current, and
    finalize once every line has a result (or the job was cancelled)."""

    def __init__(self, store: BatchStore, executor: LineExecutor, record: BatchRecord,
                 tenant: Tenant | None, lines: list[BatchLine | MalformedLine],
                 stop: asyncio.Event) -> None:
        self.store = store
        self.executor = executor
        self.batch_id = record.id
        self.endpoint = record.endpoint
        self.owner = record.owner
        self.tenant = tenant
        self.lines = lines
        self.stop = stop
        self.is_cancelled = record.status == "cancelling"
        self.progress = Progress()

    def should_stop(self) -> bool:
        return self.is_cancelled or self.stop.is_set()

    async def run(self, max_concurrent_lines: int) -> bool:
        done = await self.store.results(self.batch_id)
        for entry in done.values():
            self.progress.add(entry)
        await self.store.update_record(self.batch_id, self._start)
        for line in self.lines:
            if isinstance(line, MalformedLine) and line.key not in done:
                await self._save(line.key, error_entry(line))
        pending = [line for line in self.lines
                   if isinstance(line, BatchLine) and line.key not in done]
        log.info("batch running", batch_id=self.batch_id, lines=len(self.lines),
                 already_done=len(done), pending=len(pending))
        queue: asyncio.Queue[BatchLine] = asyncio.Queue()
        for line in pending:
            queue.put_nowait(line)
        reporter = asyncio.create_task(self._report_progress())
        try:
            async with asyncio.TaskGroup() as workers:  # one failing stops them all
                for _ in range(min(max_concurrent_lines, len(pending))):
                    workers.create_task(self._work(queue))
        finally:
            reporter.cancel()
        if self.stop.is_set() and not self.is_cancelled:
            await self.store.update_record(self.batch_id, self.progress.apply)
            return False
        await self._finalize()
        return True

    def _start(self, record: BatchRecord) -> None:
        if record.status == "validating":
            record.status = "in_progress"
            record.in_progress_at = int(time.time())
        record.request_counts.total = len(self.lines)
        self.progress.apply(record)
        self.is_cancelled = record.status == "cancelling"

    async def _work(self, queue: asyncio.Queue[BatchLine]) -> None:
        while not self.should_stop() and not queue.empty():
            line = queue.get_nowait()
            outcome = await self.executor.run(self.endpoint, line.body, self.tenant,
                                              self.should_stop)
            if outcome is not None:
                await self._save(line.key, _entry(line, outcome))

    async def _save(self, key: str, entry: bytes) -> None:
        if await self.store.save_result(self.batch_id, key, entry):
            self.progress.add(entry)

    async def _report_progress(self) -> None:
        """Every PROGRESS_INTERVAL_S: saves the counts if they moved, and learns of a cancel.
        (Writing only changes keeps the record's watchers from seeing idle updates.)"""
        reported = dataclasses.replace(self.progress)
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            current = dataclasses.replace(self.progress)
            try:
                if current != reported:
                    latest = await self.store.update_record(self.batch_id, current.apply)
                    reported = current
                else:
                    latest = await self.store.record(self.batch_id)
            except Exception as exc:  # noqa: BLE001 - NATS trouble: report next time
                log.warning("batch progress not saved", batch_id=self.batch_id, error=str(exc))
                continue
            self.is_cancelled = latest is not None and latest.status == "cancelling"

    async def _finalize(self) -> None:
        await self.store.update_record(self.batch_id, self._finalizing)
        results = await self.store.results(self.batch_id)
        missing = [line.line_number for line in self.lines if line.key not in results]
        if missing and not self.is_cancelled:
            raise RuntimeError(f"batch {self.batch_id}: lines {missing[:10]} have no result")
        outputs, errors = [], []
        for line in self.lines:  # input order
            entry = results.get(line.key)
            if entry is not None:
                (outputs if is_success(json.loads(entry)) else errors).append(entry)
        output_id = await self._write_file(output_file_id(self.batch_id), outputs)
        error_id = await self._write_file(error_file_id(self.batch_id), errors)
        progress = Progress()
        for entry in outputs + errors:
            progress.add(entry)
        record = await self.store.update_record(
            self.batch_id, lambda r: _finish(r, progress, output_id, error_id))
        log.info("batch finished", batch_id=self.batch_id, status=record.status,
                 completed=progress.completed, failed=progress.failed)

    def _finalizing(self, record: BatchRecord) -> None:
        self.is_cancelled = record.status == "cancelling"
        if not self.is_cancelled:
            record.status = "finalizing"
            record.finalizing_at = record.finalizing_at or int(time.time())

    async def _write_file(self, file_id: str, entries: list[bytes]) -> str | None:
        if not entries:
            return None
        data = b"\n".join(entries) + b"\n"
        await self.store.put_file(FileRecord(id=file_id, filename=f"{file_id}.jsonl",
                                             purpose="batch_output", owner=self.owner), data)
        return file_id


def _entry(line: BatchLine, outcome: LineOutcome) -> bytes:
    return response_entry(line.key, line.custom_id, outcome.status_code, outcome.request_id,
                          outcome.body)


def _finish(record: BatchRecord, progress: Progress, output_id: str | None,
            error_id: str | None) -> None:
    now = int(time.time())
    if record.status == "cancelling":
        record.status, record.cancelled_at = "cancelled", now
    else:
        record.status, record.completed_at = "completed", now
    record.output_file_id, record.error_file_id = output_id, error_id
    progress.apply(record)
