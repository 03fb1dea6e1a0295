"""What one step produces, after vLLM's sched/output.py: diffs for the worker, deltas for clients.

The worker keeps a row per live request. A request it has no row for (first schedule, or
resumed after preemption) arrives once as `NewRequestData`; afterwards only what changed
travels, column-wise, in `CachedRequestData`. The service packs these into the wire's
`StepInput` and unpacks `StepOutput` into `RunnerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.core.request import (
    FinishReason,
    LoraPayload,
    MultiModalPayload,
    Request,
    SamplingPayload,
)

if TYPE_CHECKING:
    from services.scheduler.core.kv_connector.metadata import (
        KVConnectorMetadata,
        KVConnectorOutput,
    )
    from services.scheduler.core.spec_decode import SpecDecodingStats


@dataclass(slots=True)
class NewRequestData:
    handle: int
    request_id: str
    token_ids: list[int]
    """Every token known: the prompt, then outputs so far (a request resumed after preemption
    recomputes them all)."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in `block_ids` (prefix-cache hits); the worker runs from here."""
    sampling: SamplingPayload
    lora: LoraPayload = None
    mm_items: MultiModalPayload = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests the worker already holds, column-wise; column i is one request."""

    handles: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to the request's block table this step (usually none)."""
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.handles)


@dataclass(slots=True)
class StateCheckpointOps:
    """A hybrid model's state copies in one step (hybrid_kv_cache_manager.py), by handle:
    restores into new requests' rows before the forward pass, saves after it."""

    restore_handles: list[int] = field(default_factory=list)
    restore_slots: list[int] = field(default_factory=list)
    save_handles: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.restore_handles or self.save_handles)


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    new_requests: list[NewRequestData]
    cached: CachedRequestData
    num_scheduled_tokens: list[int]
    """Tokens to run per request: `new_requests` first, then `cached`, in that order."""
    total_num_scheduled_tokens: int
    finished_handles: list[int]
    """Rows to drop before anything else in this step: requests finished, aborted or preempted
    since the previous step. A handle preempted and resumed in one step is here and in
    `new_requests`."""
    request_ids: list[str] = field(default_factory=list)
    """Aligned with `num_scheduled_tokens`; for logs and tests, not for the wire."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """KV blocks the worker loads from / saves to the kvstore this step."""
    scheduled_requests: list[Request] = field(default_factory=list)
    """Aligned with `num_scheduled_tokens`: the update applies the step's results to these
    objects, never to whoever holds a handle by then (async scheduling reuses handles)."""
    sampling_handles: set[int] = field(default_factory=set)
    """Requests whose scheduled tokens reach their end: each samples a token this step."""
    num_prefill_tokens: int = 0
    """Of `total_num_scheduled_tokens`, those of prompt chunks (the rest decode)."""
    state_checkpoints: StateCheckpointOps | None = None
    """A hybrid model's state copies this step; None for any other model."""

    @property
    def scheduled_handles(self) -> list[int]:
        return [new.handle for new in self.new_requests] + self.cached.handles

    @property
    def num_scheduled_tokens_by_id(self) -> dict[str, int]:
        return dict(zip(self.request_ids, self.num_scheduled_tokens))

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class RunnerOutput:
    """The worker's answer to one step: a sampled token per request whose scheduled tokens
    reached the end of its known tokens (a partial prefill samples nothing). A request that
    verified drafts may sample several: its handle then repeats, once per token, in order."""

    handles: list[int]
    sampled_token_ids: list[int]
    kv_connector_output: KVConnectorOutput | None = None
    rejected: dict[int, str] = field(default_factory=dict)
    """Requests (by handle) the worker gave up for their own input, and why."""
    deferred: set[int] = field(default_factory=set)
    """Requests (by handle) that reached their sampling position before their grammar
    compiled on the worker: no token, and their last position is to be computed again."""
    num_spec_tokens: dict[int, int] = field(default_factory=dict)
    """Speculative decoding: drafts the worker proposed (and holds) for a request's next
    step, by handle; a request not named has none."""

    def sampled_by_handle(self) -> dict[int, list[int]]:
        sampled: dict[int, list[int]] = {}
        for handle, token_id in zip(self.handles, self.sampled_token_ids):
            tokens = sampled.get(handle)
            if tokens is None:
                sampled[handle] = [token_id]
            else:
                tokens.append(token_id)
        return sampled


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    handle: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    stop_token_id: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finished_request: Request | None = None
    """Set when the request finished: its timestamps feed the latency metrics. Not for the wire."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    """Cumulative tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Cumulative tokens found there."""
    num_preemptions: int
    """Cumulative."""
    num_waiting_tokens: int = 0
    prefill_token_cap: int = 0
    """The last step's cap on prompt tokens beside decodes (the budget when uncapped)."""
    spec_decoding: SpecDecodingStats | None = None
    """Cumulative; None when speculative decoding is off."""
