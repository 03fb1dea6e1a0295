"""The batch runner service: takes one job at a time from the jobs stream (a durable pull
consumer shared by every runner) and runs it, reporting progress to JetStream so the job
stays with this runner; a runner that dies stops reporting, and the job is redelivered.

It is a client of the mesh like the gateway, in process: it runs the shared request path
(services/common/frontend) with its own mesh client (tokenizers send its lines' text to its
instance id) and its own view of the mesh built from heartbeats. It is given
the gateway's API keys (--api-key, rate limits) to run each batch as the key that created it.
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import ValidationError

from services.batch.job_runner import JobRunner
from services.batch.line_executor import LineExecutor
from services.batch.settings import BatchSettings
from services.common.metrics import GatewayMetrics
from services.common.service import Service
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.batch_jobs.records import BatchJob
from services.frontend.runtime import FrontendRuntime
from services.frontend.tenancy.auth import ApiKeys

FETCH_TIMEOUT_S = 1.0      # also how long a drain waits for the fetch loop to notice
FAILED_JOB_RETRY_S = 5.0   # a job that raised is redelivered after this


class BatchService(Service):
    name = "batch"

    def __init__(self, settings: BatchSettings) -> None:
        super().__init__(settings)
        self.settings: BatchSettings = settings
        self.metrics = GatewayMetrics(self.registry)
        self.frontend = FrontendRuntime(settings, self.metrics, self.log)
        self.runner: JobRunner | None = None
        self.api_keys: ApiKeys | None = None
        self.stop_jobs = asyncio.Event()
        self._jobs: JetStreamContext.PullSubscription | None = None
        self._consuming: asyncio.Task[None] | None = None

    async def setup(self) -> None:
        bus = self.connected_bus
        ctx = await self.frontend.start(bus, self.subjects, self.instance_id, self.background)
        store = await BatchStore.open(bus.client.jetstream(), self.subjects,
                                      self.settings.jetstream_replicas)
        executor = LineExecutor(ctx, self.settings.batch_priority, self.settings.line_retry_s)
        self.api_keys = ApiKeys.from_settings(self.settings, self.settings.namespace)
        self.runner = JobRunner(store, executor, self.settings.max_concurrent_lines,
                                self.api_keys)
        self._jobs = await store.job_subscription(self.settings.job_ack_wait_s)
        self._consuming = self.background.spawn(self._consume(), name="batch job loop")

    async def _consume(self) -> None:
        assert self._jobs is not None
        while not self.stop_jobs.is_set():
            try:
                messages = await self._jobs.fetch(1, timeout=FETCH_TIMEOUT_S)
                await self._run_job(messages[0])
            except nats.errors.TimeoutError:
                continue  # no job waiting
            except nats.errors.Error as exc:  # reconnecting: the job comes back after its ack wait
                self.log.warning("batch job loop interrupted", error=str(exc))
                await asyncio.sleep(FETCH_TIMEOUT_S)

    async def _run_job(self, message: Msg) -> None:
        assert self.runner is not None
        try:
            job = BatchJob.from_json(message.data)
        except ValidationError as exc:
            self.log.error("dropping a malformed batch job message", error=str(exc))
            await message.term()
            return
        attempt = message.metadata.num_delivered
        self.log.info("batch job taken", batch_id=job.batch_id, delivery=attempt)
        keep_alive = asyncio.create_task(self._keep_alive(message))
        try:
            finished = await self.runner.run(job, self.stop_jobs)
        except Exception:
            self.log.exception("batch job failed; it will be retried", batch_id=job.batch_id)
            await message.nak(delay=FAILED_JOB_RETRY_S)
            return
        finally:
            keep_alive.cancel()
        if finished:
            await message.ack()
        else:
            await message.nak()  # drained: another runner may take it at once

    async def _keep_alive(self, message: Msg) -> None:
        """Tells JetStream the job is still being worked on, well within its ack wait."""
        while True:
            await asyncio.sleep(self.settings.job_ack_wait_s / 3)
            try:
                await message.in_progress()
            except nats.errors.Error as exc:
                self.log.warning("cannot extend the batch job's ack wait", error=str(exc))

    def readiness(self) -> tuple[bool, str]:
        if self._consuming is not None and self._consuming.done():
            return False, "the job loop stopped"
        return True, ""

    async def drain(self) -> None:
        """Stops taking jobs; the current job's lines in flight finish, then it is handed back.
        (Past --drain-timeout-s it is not handed back: it returns after its ack wait.)"""
        self.stop_jobs.set()
        if self._consuming is not None:
            await self._consuming

    async def close(self) -> None:
        if self.api_keys is not None:
            await self.api_keys.close()
        if self._jobs is not None:
            # NOTE: an open pull subscription makes the bus's drain wait its whole timeout.
            await self._jobs.unsubscribe()
