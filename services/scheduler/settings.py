"""The scheduler's settings (flags keep vLLM's names where the concept is the same)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import wire
from services.common.kv_index import KVIndexSettings
from services.common.settings import CommonSettings, EngineSettings, setting
from services.common.timing import WORKER_HEARTBEAT_TIMEOUT_S, check_liveness_timeout
from services.scheduler.core.config import SchedulerConfig


@dataclass
class SchedulerSettings(CommonSettings, EngineSettings, KVIndexSettings):
    enable_prefix_caching: bool = setting(True, "Reuse the KV of shared prompt prefixes")
    prefix_caching_hash_algo: str = setting("sha256", "Block hash function",
                                            choices=("sha256", "xxh3_128"))
    long_prefill_token_threshold: int = setting(
        0, "Most tokens one request may take in a step (0: no cap beyond the budget)")
    max_itl_factor: float = setting(
        2.0, "A step that carries decodes takes at most this many times a decode-only step: "
        "prefill chunks beside running streams are sized from the worker's measured step "
        "times, so a prompt arriving does not stall them (0: off, chunks fill the budget)")
    # NOTE: priority with every request at its default priority (0) is fcfs; it is the
    # default so batch jobs (submitted at a low priority) yield to interactive traffic.
    scheduling_policy: str = setting("priority", "Which waiting request runs first: by the "
                                     "request's priority (lower first), then arrival; or fcfs, "
                                     "ignoring priorities", choices=("fcfs", "priority"))
    max_num_queued_reqs: int = setting(0, "Admission control: most waiting requests "
                                       "(0: unbounded); beyond it clients get 503")
    max_num_queued_tokens: int = setting(0, "Admission control: most waiting prompt tokens "
                                         "(0: unbounded)")
    worker_step_timeout_s: float = setting(600.0, "Longest one step may take on the worker")
    worker_heartbeat_timeout_s: float = setting(
        WORKER_HEARTBEAT_TIMEOUT_S, "Declare the worker lost after this long without its "
        "heartbeat")
    worker_rejoin_timeout_s: float = setting(
        60.0, "How long requests wait, preempted, for a lost worker to return before they "
        "are given up to the gateways, which move them to another engine")
    stall_timeout_s: float = setting(
        120.0, "Report not ready when no step completed for this long while work waits")
    # KV connector (docs/kvstore.md): active with --redis-url and prefix caching.
    enable_kv_connector: bool = setting(True, "Load prefixes from and save blocks to the "
                                        "kvstore (needs --redis-url)")
    kv_role: str = setting("both", "This engine in prefill/decode disaggregation: both (load "
                           "and save), producer (prefill engine: saves) or consumer (decode "
                           "engine: loads)", choices=("both", "producer", "consumer"))
    kv_save_mode: str = setting(
        "on_reuse", "Save a prompt's blocks when a later request first reuses them (a prefix "
        "seen once seldom returns), every full prompt block as soon as it is computed, or "
        "cached blocks when the pool reuses them",
        choices=("on_reuse", "write_through", "on_evict"))
    kv_load_failure_policy: str = setting(
        "recompute", "A load that fails (bad checksum, store gone, timeout): recompute what "
        "did not arrive intact, or fail the request", choices=("recompute", "fail"))
    kv_lookup_timeout_s: float = setting(0.25, "Longest a request's kvstore lookup may delay "
                                         "its admission")
    enable_kv_events: bool = setting(False, "Publish the KV pool's BlockStored / BlockRemoved "
                                     "events on JetStream")
    # NOTE: on by default: 1.10x tokens/s at concurrency 32 on two cores, and the scheduler's
    # update and the deltas' publish leave the worker's critical path (benchmarks.md 10q).
    async_scheduling: bool = setting(
        True, "Schedule and send each step while the one before it runs, so the worker "
        "never waits for scheduling and messaging (vLLM's --async-scheduling). Off by itself "
        "with speculative decoding: a step's drafts are known only once the step before "
        "it ends")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_liveness_timeout("--worker-heartbeat-timeout-s", self.worker_heartbeat_timeout_s)

    @property
    def runs_async(self) -> bool:
        """Whether steps are scheduled ahead: asked for, and no speculative decoding."""
        return self.async_scheduling and self.speculative is None

    def scheduler_config(self, worker: wire.WorkerInfo) -> SchedulerConfig:
        speculative = self.speculative
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=worker.max_model_len,
            block_size=worker.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_state_checkpoints=worker.num_state_checkpoints,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_itl_factor=self.max_itl_factor,
            policy=self.scheduling_policy,
            max_num_queued_reqs=self.max_num_queued_reqs or None,
            max_num_queued_tokens=self.max_num_queued_tokens or None,
            num_gpu_blocks=worker.num_blocks,
            hash_algo=self.prefix_caching_hash_algo,
            enable_kv_events=self.enable_kv_events,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            max_loras=worker.max_loras, max_cpu_loras=worker.max_cpu_loras,
            async_scheduling=self.runs_async,
        )
