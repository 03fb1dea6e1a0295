from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_NONE: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class GrammarKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_KIND_NONE: _ClassVar[GrammarKind]
    GRAMMAR_KIND_JSON_SCHEMA: _ClassVar[GrammarKind]
    GRAMMAR_KIND_REGEX: _ClassVar[GrammarKind]
    GRAMMAR_KIND_EBNF: _ClassVar[GrammarKind]
    GRAMMAR_KIND_STRUCTURAL_TAG: _ClassVar[GrammarKind]
FINISH_REASON_NONE: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
GRAMMAR_KIND_NONE: GrammarKind
GRAMMAR_KIND_JSON_SCHEMA: GrammarKind
GRAMMAR_KIND_REGEX: GrammarKind
GRAMMAR_KIND_EBNF: GrammarKind
GRAMMAR_KIND_STRUCTURAL_TAG: GrammarKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "logit_bias_token_ids", "logit_bias_values", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: bytes
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    prompt_logprobs: int
    logit_bias_token_ids: bytes
    logit_bias_values: bytes
    grammar: GrammarSpec
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[bytes] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias_token_ids: _Optional[bytes] = ..., logit_bias_values: _Optional[bytes] = ..., grammar: _Optional[_Union[GrammarSpec, _Mapping]] = ...) -> None: ...

class GrammarSpec(_message.Message):
    __slots__ = ("kind", "spec", "disable_any_whitespace", "num_resumed_tokens", "reasoning")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    kind: GrammarKind
    spec: str
    disable_any_whitespace: bool
    num_resumed_tokens: int
    reasoning: ReasoningMarkers
    def __init__(self, kind: _Optional[_Union[GrammarKind, str]] = ..., spec: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., num_resumed_tokens: _Optional[int] = ..., reasoning: _Optional[_Union[ReasoningMarkers, _Mapping]] = ...) -> None: ...

class ReasoningMarkers(_message.Message):
    __slots__ = ("start", "end", "opens_in_prompt", "start_token_ids", "end_token_ids")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    OPENS_IN_PROMPT_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    start: str
    end: str
    opens_in_prompt: bool
    start_token_ids: bytes
    end_token_ids: bytes
    def __init__(self, start: _Optional[str] = ..., end: _Optional[str] = ..., opens_in_prompt: _Optional[bool] = ..., start_token_ids: _Optional[bytes] = ..., end_token_ids: _Optional[bytes] = ...) -> None: ...

class LoraRequest(_message.Message):
    __slots__ = ("lora_id", "name", "path")
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    name: str
    path: str
    def __init__(self, lora_id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("content_hash", "offset", "length", "is_embed", "data_key", "num_embeds")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    offset: int
    length: int
    is_embed: bytes
    data_key: str
    num_embeds: int
    def __init__(self, content_hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., is_embed: _Optional[bytes] = ..., data_key: _Optional[str] = ..., num_embeds: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("service", "instance_id", "ready", "reason", "time", "engine_id", "engine", "reconnects")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance_id: str
    ready: bool
    reason: str
    time: float
    engine_id: str
    engine: EngineInfo
    reconnects: int
    def __init__(self, service: _Optional[str] = ..., instance_id: _Optional[str] = ..., ready: _Optional[bool] = ..., reason: _Optional[str] = ..., time: _Optional[float] = ..., engine_id: _Optional[str] = ..., engine: _Optional[_Union[EngineInfo, _Mapping]] = ..., reconnects: _Optional[int] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "block_size", "num_blocks", "num_running", "num_waiting", "kv_cache_usage", "num_waiting_tokens", "worker_ready", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_role", "num_steps", "external_prefix_cache_queries", "external_prefix_cache_hits", "max_num_seqs", "max_loras", "lora_ids", "num_running_prefill_tokens", "is_sleeping", "weight_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_READY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_waiting_tokens: int
    worker_ready: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_role: str
    num_steps: int
    external_prefix_cache_queries: int
    external_prefix_cache_hits: int
    max_num_seqs: int
    max_loras: int
    lora_ids: bytes
    num_running_prefill_tokens: int
    is_sleeping: bool
    weight_version: str
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_waiting_tokens: _Optional[int] = ..., worker_ready: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_role: _Optional[str] = ..., num_steps: _Optional[int] = ..., external_prefix_cache_queries: _Optional[int] = ..., external_prefix_cache_hits: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_loras: _Optional[int] = ..., lora_ids: _Optional[bytes] = ..., num_running_prefill_tokens: _Optional[int] = ..., is_sleeping: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class LogprobColumns(_message.Message):
    __slots__ = ("token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    logprobs: bytes
    num_top: int
    top_token_ids: bytes
    top_logprobs: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., num_top: _Optional[int] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ...) -> None: ...

class FinishInfo(_message.Message):
    __slots__ = ("request_id", "finish_reason", "stop_reason", "stop_token_id", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "error", "queue_time_s", "prefill_time_s", "decode_time_s", "detokenize_time_s", "engine_id", "num_preemptions", "movable", "error_code", "num_draft_tokens", "num_accepted_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MOVABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: FinishReason
    stop_reason: str
    stop_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str
    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    detokenize_time_s: float
    engine_id: str
    num_preemptions: int
    movable: bool
    error_code: str
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., error: _Optional[str] = ..., queue_time_s: _Optional[float] = ..., prefill_time_s: _Optional[float] = ..., decode_time_s: _Optional[float] = ..., detokenize_time_s: _Optional[float] = ..., engine_id: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., movable: _Optional[bool] = ..., error_code: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...
