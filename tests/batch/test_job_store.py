"""The batch plane in JetStream: idempotent records, compare-and-set updates, first result
wins, files with their records, and the jobs work queue."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors as js_errors
import pytest

from services.common.jetstream import retry_transient
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.batch_jobs.records import BatchJob, BatchRecord, FileRecord


def job(batch_id: str = "batch_1") -> BatchJob:
    return BatchJob(batch_id=batch_id, input_file_id="file-1",
                    endpoint="/v1/chat/completions", created_at=100)


async def test_create_record_keeps_the_first(store: BatchStore) -> None:
    first = await store.create_record(BatchRecord.from_job(job()))
    assert first.status == "validating" and first.expires_at == 100 + 24 * 3600
    await store.update_record("batch_1", lambda r: setattr(r, "status", "in_progress"))
    again = await store.create_record(BatchRecord.from_job(job()))
    assert again.status == "in_progress"
    assert await store.record("batch_missing") is None
    assert await store.record("not a key!") is None


class _FailoverBucket:
    """A KV bucket as a client sees it while a stream elects a leader: this call's
    earlier try landed but its reply was lost, so the create meets the key, and the entry
    cannot be read back at first (nats-py's create then raises KeyNotFoundError)."""

    def __init__(self, bucket, unreadable_reads: int) -> None:
        self._bucket = bucket
        self._unreadable_reads = unreadable_reads

    async def create(self, key: str, value: bytes) -> None:
        await self._bucket.create(key, value)          # the try whose reply was lost
        raise js_errors.KeyNotFoundError

    async def get(self, key: str):
        if self._unreadable_reads:
            self._unreadable_reads -= 1
            raise js_errors.KeyNotFoundError
        return await self._bucket.get(key)


async def test_create_record_waits_out_an_entry_not_yet_readable(store: BatchStore) -> None:
    store._records = _FailoverBucket(store._records, unreadable_reads=2)
    record = BatchRecord.from_job(job("batch_failover"))
    created = await retry_transient(lambda: store.create_record(record), within_s=10.0)
    assert created == record
    assert store._records._unreadable_reads == 0


async def test_a_result_saved_in_a_failover_is_kept_and_not_saved_again(
        store: BatchStore) -> None:
    store._results = _FailoverBucket(store._results, unreadable_reads=0)
    assert not await store.save_result("batch_f", "c-1", b"first")   # it has one: its own
    assert await store.results("batch_f") == {"c-1": b"first"}


async def test_concurrent_updates_never_lose_a_change(store: BatchStore) -> None:
    await store.create_record(BatchRecord.from_job(job()))

    def bump(record: BatchRecord) -> None:
        record.request_counts.completed += 1

    await asyncio.gather(*(store.update_record("batch_1", bump) for _ in range(20)))
    record = await store.record("batch_1")
    assert record is not None and record.request_counts.completed == 20


async def test_the_first_result_of_a_line_wins(store: BatchStore) -> None:
    assert await store.save_result("batch_1", "c-aa", b"first")
    assert not await store.save_result("batch_1", "c-aa", b"second")
    assert await store.save_result("batch_1", "line-3", b"other")
    assert await store.save_result("batch_2", "c-aa", b"elsewhere")
    assert await store.results("batch_1") == {"c-aa": b"first", "line-3": b"other"}
    assert await store.results("batch_3") == {}


async def test_every_result_is_read_however_many_and_however_many_readers(
        store: BatchStore) -> None:
    # More results than one fetch returns, read by many readers at once: each read is whole
    # (a KV watch's "all delivered" marker could come before the values and cut reads short).
    entries = {f"line-{i}": f"entry {i}".encode() for i in range(600)}
    await asyncio.gather(*(store.save_result("batch_big", k, v) for k, v in entries.items()))
    reads = await asyncio.gather(*(store.results("batch_big") for _ in range(8)))
    assert all(read == entries for read in reads)
    assert len(await store.list_records()) == 0


async def test_files_keep_their_record(store: BatchStore) -> None:
    assert await store.list_files() == []
    saved = await store.put_file(FileRecord(id="file-1", filename="in.jsonl", purpose="batch"),
                                 b"line\n")
    assert saved.bytes == 5
    assert await store.file_record("file-1") == saved
    assert await store.file_content("file-1") == b"line\n"
    assert [f.id for f in await store.list_files()] == ["file-1"]
    assert await store.delete_file("file-1")
    assert await store.file_record("file-1") is None
    assert await store.file_content("file-1") is None
    assert not await store.delete_file("file-1")


async def test_a_job_goes_to_one_runner_and_comes_back_when_not_acked(
        store: BatchStore) -> None:
    await store.submit(job("batch_a"))
    await store.submit(job("batch_a"))  # a retried publish: stored once
    jobs = await store.job_subscription(ack_wait_s=0.5)
    try:
        [message] = await jobs.fetch(1, timeout=1)
        assert BatchJob.from_json(message.data).batch_id == "batch_a"
        [again] = await jobs.fetch(1, timeout=3)  # never acked: redelivered
        assert again.metadata.num_delivered == 2
        await again.ack()
        with pytest.raises(nats.errors.TimeoutError):
            await jobs.fetch(1, timeout=1)
    finally:
        await jobs.unsubscribe()
