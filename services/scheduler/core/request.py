"""A request as the engine core sees it, after vLLM's v1/request.py.

One rule drives it: `num_computed_tokens` (tokens whose KV is in the cache) catches up with
`num_tokens` (prompt + outputs). A request samples a token in the step that makes them equal.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from typing import TypeAlias

from services.common.block_hash import BlockHash, BlockHasher, MultiModalSpan

# NOTE: the worker's sampling parameters (the service stores the wire's SamplingParams; the
# step codec sends it on). The core never reads it, so it stays opaque: `object` names no
# wire type and lets no core code read its fields unnoticed, and no per-request conversion
# copies fields the core would never use.
SamplingPayload: TypeAlias = object
LoraPayload: TypeAlias = object   # the wire's LoraRequest, carried to the worker the same way
MultiModalPayload: TypeAlias = object   # the wire's MultiModalItems, the same way


class FinishReason(enum.IntEnum):
    """Why a request ended; the service hands it on as the wire enum of the same value
    (tests/scheduler/test_finish_reason.py keeps the two equal)."""

    STOP = 1      # EOS or a stop token id
    LENGTH = 2    # max_tokens or max_model_len
    ABORT = 3     # client gone, stop string, deadline, admin
    ERROR = 4     # the engine failed the request

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    WAITING_FOR_REMOTE_KVS = 2   # its blocks are being loaded from the kvstore
    PREEMPTED = 3
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> FinishReason | None:
        return _STATUS_TO_FINISH_REASON.get(self)


_STATUS_TO_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    # NOTE: slots: the scheduler reads these fields for every running request every step.
    __slots__ = (
        "request_id", "prompt_token_ids", "num_prompt_tokens", "output_token_ids",
        "_all_token_ids", "max_tokens", "min_tokens", "stop_token_ids", "eos_token_ids",
        "ignore_eos", "stop_ids", "priority", "cache_salt", "lora_id", "lora", "mm_spans",
        "mm_items", "skip_prefix_cache",
        "sampling", "status", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
        "handle", "arrival_order", "stop_token_id", "error", "error_code", "deadline",
        "block_hasher", "block_hashes",
        "_next_hash_at", "arrival_time", "first_scheduled_time", "first_token_time",
        "last_token_time", "finished_time", "do_remote_decode", "kv_store_hit",
        "num_spec_tokens", "num_draft_tokens", "num_accepted_tokens",
        "num_output_placeholders", "has_grammar", "grammar_after_reasoning", "worker_sampled",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        stop_token_ids: Collection[int] = (),
        eos_token_ids: Collection[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        arrival_time: float,
        cache_salt: str = "",
        lora_id: int = 0,
        lora: LoraPayload = None,
        mm_spans: Sequence[MultiModalSpan] = (),
        mm_items: MultiModalPayload = None,
        skip_prefix_cache: bool = False,
        sampling: SamplingPayload = None,
        block_hasher: BlockHasher | None = None,
        do_remote_decode: bool = False,
        has_grammar: bool = False,
        grammar_after_reasoning: bool = False,
    ) -> None:
        # NOTE: numpy arrays (unpacked from the wire) become plain ints: faster to scan and hash.
        prompt = (prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist")
                  else list(prompt_token_ids))
        if not prompt:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.num_prompt_tokens = len(prompt)
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ignore_eos = ignore_eos
        # Every token that ends the request once min_tokens are out: one set test per step.
        self.stop_ids = self.stop_token_ids | (frozenset() if ignore_eos else self.eos_token_ids)
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.lora = lora
        self.mm_spans = tuple(mm_spans)
        """The prompt's images: their content hashes go into the hashes of their blocks."""
        self.mm_items = mm_items
        """The images as the worker needs them; opaque to the core."""
        """The adapter as the worker needs it (id, name, path); opaque to the core."""
        self.skip_prefix_cache = skip_prefix_cache
        self.sampling = sampling
        self.do_remote_decode = do_remote_decode
        """Prefill/decode disaggregation: this engine only prefills; the request finishes once
        the kvstore holds its prompt's KV (the KV connector holds the finish until then)."""
        self.has_grammar = has_grammar
        """Structured output: the worker defers its sampling while the grammar compiles."""
        self.grammar_after_reasoning = grammar_after_reasoning
        """The grammar applies after a reasoning section: it may compile (and defer) late."""
        self.kv_store_hit: list[str] = []
        """The kvstore address of each leading block the store held when the request was
        admitted (the KV connector's lookup); emptied once the connector used it."""

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prefix-cache hit tokens at first schedule (local hits plus tokens loaded from the
        kvstore); fixed afterwards."""
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        """Steps scheduled for this request whose sampled token is not back yet (at most 1
        without async scheduling, and 0 between steps)."""
        self.worker_sampled = False
        """The worker returned a token for it since it last got a worker row."""
        self.num_spec_tokens = 0
        """Speculative decoding: drafts the worker proposed for this request's next step
        (it holds them; 0 once the worker has no row for the request)."""
        self.num_draft_tokens = 0
        """Drafts verified so far, and how many of them were accepted."""
        self.num_accepted_tokens = 0
        self.handle: int | None = None
        """Unique int32 the scheduler assigns at add_request; the worker names the request by it."""
        self.arrival_order = 0
        """Admission sequence number: breaks ties between equal arrival times."""
        self.stop_token_id: int | None = None
        self.error: str | None = None
        self.error_code: str | None = None
        """With `error`: what kind ("invalid_request", "deadline_exceeded"; None: the
        engine's failure)."""
        self.deadline: float | None = None
        """On the scheduler's clock: the request ends with an error once it passes."""

        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

        self.block_hashes: list[BlockHash] = []
        self.block_hasher: BlockHasher | None = None
        self._next_hash_at = -1
        if block_hasher is not None:
            self.attach_block_hasher(block_hasher)

    # ---- tokens -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs. The live list: read it, never change it."""
        return self._all_token_ids

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if len(self._all_token_ids) == self._next_hash_at:
            self._hash_new_full_blocks()

    # ---- prefix-cache block hashes ------------------------------------------------------
    def attach_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Hashes the full blocks known so far; later ones are hashed as tokens complete them."""
        self.block_hasher = block_hasher
        self.block_hashes = block_hasher.hash_blocks(self._all_token_ids, self.cache_salt,
                                                     self.lora_id, self.mm_spans)
        self._next_hash_at = (len(self.block_hashes) + 1) * block_hasher.block_size

    def _hash_new_full_blocks(self) -> None:
        # NOTE: hash just the new block; BlockHasher.extend would re-read every token.
        hasher = self.block_hasher
        assert hasher is not None
        size = hasher.block_size
        hashes = self.block_hashes
        tokens = self._all_token_ids
        while len(tokens) >= (len(hashes) + 1) * size:
            index = len(hashes)
            parent = hashes[-1] if hashes else hasher.root_hash
            hashes.append(hasher.hash_block(
                parent, tokens[index * size:(index + 1) * size],
                hasher.extra_keys(index, self.cache_salt, self.lora_id, self.mm_spans)))
        self._next_hash_at = (len(hashes) + 1) * size

    # ---- status -------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _STATUS_TO_FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, handle={self.handle}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
