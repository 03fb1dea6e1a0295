"""Every NATS subject name of the mesh, in one place.

Instance-addressed subjects carry state that lives in one place (an engine's queues, a
tokenizer's detokenizer state, a gateway's open streams); stateless work uses queue groups.
All names sit under a namespace so several meshes can share one NATS server.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENIZER_QUEUE = "tokenizer"
BATCH_RUNNER_CONSUMER = "batch-runner"   # durable pull consumer shared by every batch runner


@dataclass(frozen=True)
class Subjects:
    namespace: str = "mesh"

    # Every service, periodically: wire.Heartbeat.
    @property
    def heartbeat(self) -> str:
        return f"{self.namespace}.heartbeat"

    # Gateway -> any tokenizer (queue group), request/reply.
    @property
    def tokenizer_encode(self) -> str:
        return f"{self.namespace}.tokenizer.encode"

    @property
    def tokenizer_detokenize(self) -> str:
        return f"{self.namespace}.tokenizer.detokenize"

    # Scheduler -> the tokenizer holding a request's detokenizer state.
    def tokenizer_deltas(self, tokenizer_id: str) -> str:
        return f"{self.namespace}.tokenizer.{tokenizer_id}.deltas"

    def tokenizer_release(self, tokenizer_id: str) -> str:
        return f"{self.namespace}.tokenizer.{tokenizer_id}.release"

    # Tokenizer -> the gateway holding the client connection.
    def gateway_outputs(self, gateway_id: str) -> str:
        return f"{self.namespace}.gateway.{gateway_id}.outputs"

    # Anyone -> one service instance, request/reply: its /metrics, Prometheus' text format
    # (the gateway's /metrics re-exports every engine's series from its scheduler's).
    def service_metrics(self, service: str, instance_id: str) -> str:
        return f"{self.namespace}.metrics.{service}.{instance_id}"

    # Gateway -> one engine's scheduler.
    def engine_submit(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.submit"

    def engine_abort(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.abort"

    def engine_admin(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.admin"

    # Scheduler <-> its worker.
    def worker_step(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.worker.step"

    def worker_step_channel(self, engine_id: str, incarnation: int) -> str:
        """Not a subject: the abstract Unix socket name of the worker's local step channel
        (services/common/step_channel.py); each worker start listens on a new one."""
        return f"llm-mesh/{self.namespace}/engine/{engine_id}/worker/{incarnation}/step"

    def worker_info(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.worker.info"

    def worker_hello(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.worker.hello"

    # Sleep mode (--enable-sleep-mode): release / restore the weights and KV cache.
    def worker_sleep(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.worker.sleep"

    def worker_wake_up(self, engine_id: str) -> str:
        return f"{self.namespace}.engine.{engine_id}.worker.wake_up"

    def worker_weights(self, engine_id: str) -> str:
        """Weight updates: load, commit or discard new weights (WeightUpdateRequest)."""
        return f"{self.namespace}.engine.{engine_id}.worker.weights"

    # KV cache events (docs/kvstore.md): engines and kvstore nodes -> any subscriber, on a
    # JetStream stream with bounded retention; a subscriber that sees a gap asks the
    # publisher for a snapshot (request/reply).
    def kv_events(self, publisher_id: str) -> str:
        return f"{self.namespace}.kv.events.{publisher_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.namespace}.kv.events.>"

    @property
    def kv_events_stream(self) -> str:
        return f"{self._bucket_prefix}-kv-events"

    def kv_snapshot(self, publisher_id: str) -> str:
        return f"{self.namespace}.kv.snapshot.{publisher_id}"

    # Batch jobs (docs/batch.md): anyone -> one batch runner, through a JetStream work queue.
    @property
    def batch_jobs(self) -> str:
        return f"{self.namespace}.batch.jobs"

    # Stored responses (/v1/responses): a KV bucket of response records, and the events of
    # background responses on a stream, so a client resumes through any gateway.
    def response_events(self, response_id: str) -> str:
        return f"{self.namespace}.responses.events.{response_id}"

    @property
    def response_events_all(self) -> str:
        return f"{self.namespace}.responses.events.>"

    @property
    def response_cancel(self) -> str:          # any gateway -> the one running the response
        return f"{self.namespace}.responses.cancel"

    @property
    def response_events_stream(self) -> str:
        return f"{self._bucket_prefix}-response-events"

    @property
    def responses_bucket(self) -> str:         # KV: response id -> its record
        return f"{self._bucket_prefix}-responses"

    # JetStream stream and bucket names allow no dots: the namespace's dots become dashes.
    @property
    def batch_jobs_stream(self) -> str:
        return f"{self._bucket_prefix}-batch-jobs"

    @property
    def batch_records_bucket(self) -> str:     # KV: batch id -> the OpenAI Batch object
        return f"{self._bucket_prefix}-batches"

    @property
    def batch_results_bucket(self) -> str:     # KV: "<batch id>.<line key>" -> its result line
        return f"{self._bucket_prefix}-batch-results"

    @property
    def batch_files_bucket(self) -> str:       # Object Store: file id -> JSONL bytes
        return f"{self._bucket_prefix}-batch-files"

    @property
    def mm_inputs_bucket(self) -> str:         # Object Store: data key -> an image's tensors
        return f"{self._bucket_prefix}-mm-inputs"

    @property
    def _bucket_prefix(self) -> str:
        return self.namespace.replace(".", "-")
