"""Scheduler knobs, named as vLLM's SchedulerConfig / CacheConfig where the concept matches.

The service builds one from its settings (SchedulerSettings.scheduler_config); the defaults
here are the product's defaults, so an engine core built in a test or a benchmark runs as
the mesh does unless told otherwise (tests/common/test_settings_sources.py keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in the running batch."""
    max_num_batched_tokens: int = 128
    """Token budget of one step, decodes and prefill chunks together."""
    max_model_len: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_state_checkpoints: int = 0
    """A hybrid model's worker: the state checkpoint slots it holds, which its prefix cache
    needs (hybrid_kv_cache_manager.py). 0: the model keeps no recurrent state."""
    long_prefill_token_threshold: int = 0
    """Most tokens one request may take in a step (0 = off)."""
    max_itl_factor: float = 2.0
    """A step carrying decodes takes at most this many times a decode-only step: its prefill
    chunks are sized by the fitted step time (step_time.py). 0: off, prefill fills the budget."""
    policy: str = "priority"
    """"fcfs" or "priority" (lower `priority` value runs first and is preempted last)."""
    max_num_queued_reqs: int | None = None
    """Admission control: most waiting requests (None = unbounded)."""
    max_num_queued_tokens: int | None = None
    """Admission control: most prompt tokens waiting (None = unbounded)."""
    num_gpu_blocks: int | None = None
    """KV blocks the worker allocated, block 0 included; set once the worker has sized its pool."""
    hash_algo: str = "sha256"
    hash_seed: str = "llm-mesh"
    enable_kv_events: bool = False
    num_speculative_tokens: int = 0
    """Most drafts one request verifies in a step (0: speculative decoding off)."""
    max_loras: int = 0
    """LoRA adapters one step may mix, the worker's slots (0: the engine serves no LoRA)."""
    max_cpu_loras: int = 0
    """Adapters the worker keeps in host memory."""
    async_scheduling: bool = True
    """Schedule step N+1 while step N runs (vLLM's async scheduling): each request sampling
    in step N is scheduled for the position after it before its token is back. Off with
    speculative decoding (num_speculative_tokens)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_itl_factor and self.max_itl_factor <= 1:
            raise ValueError("max_itl_factor must be 0 (off) or above 1")
        if self.async_scheduling and self.num_speculative_tokens:
            raise ValueError("async scheduling does not combine with speculative decoding: "
                             "a step's drafts are known only once the step before it ends")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the reserved null block)")
