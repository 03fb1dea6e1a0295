from services.common.wire_pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "tokenizer_id", "arrival_time", "do_remote_decode", "deadline_s", "lora", "mm_items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: bytes
    sampling: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    tokenizer_id: str
    arrival_time: float
    do_remote_decode: bool
    deadline_s: float
    lora: _common_pb2.LoraRequest
    mm_items: _containers.RepeatedCompositeFieldContainer[_common_pb2.MultiModalItem]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., arrival_time: _Optional[float] = ..., do_remote_decode: _Optional[bool] = ..., deadline_s: _Optional[float] = ..., lora: _Optional[_Union[_common_pb2.LoraRequest, _Mapping]] = ..., mm_items: _Optional[_Iterable[_Union[_common_pb2.MultiModalItem, _Mapping]]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "http_status", "error", "error_code", "retry_after_s", "scheduler_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    http_status: int
    error: str
    error_code: str
    retry_after_s: float
    scheduler_id: str
    def __init__(self, accepted: _Optional[bool] = ..., http_status: _Optional[int] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "reason")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: _common_pb2.FinishReason
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class AdminRequest(_message.Message):
    __slots__ = ("command", "level", "tags", "model_path", "weight_version")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    command: str
    level: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    model_path: str
    weight_version: str
    def __init__(self, command: _Optional[str] = ..., level: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ..., model_path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class AdminReply(_message.Message):
    __slots__ = ("ok", "error", "is_sleeping", "http_status", "weight_version", "seconds", "num_requests_finished_first")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FINISHED_FIRST_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    is_sleeping: bool
    http_status: int
    weight_version: str
    seconds: float
    num_requests_finished_first: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., is_sleeping: _Optional[bool] = ..., http_status: _Optional[int] = ..., weight_version: _Optional[str] = ..., seconds: _Optional[float] = ..., num_requests_finished_first: _Optional[int] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class SleepReply(_message.Message):
    __slots__ = ("error", "sleeping_tags", "seconds")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_TAGS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    error: str
    sleeping_tags: _containers.RepeatedScalarFieldContainer[str]
    seconds: float
    def __init__(self, error: _Optional[str] = ..., sleeping_tags: _Optional[_Iterable[str]] = ..., seconds: _Optional[float] = ...) -> None: ...

class WeightUpdateRequest(_message.Message):
    __slots__ = ("command", "model_path", "weight_version")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    command: str
    model_path: str
    weight_version: str
    def __init__(self, command: _Optional[str] = ..., model_path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class WeightUpdateReply(_message.Message):
    __slots__ = ("error", "http_status", "seconds", "weight_version", "kv_fingerprint")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    error: str
    http_status: int
    seconds: float
    weight_version: str
    kv_fingerprint: str
    def __init__(self, error: _Optional[str] = ..., http_status: _Optional[int] = ..., seconds: _Optional[float] = ..., weight_version: _Optional[str] = ..., kv_fingerprint: _Optional[str] = ...) -> None: ...

class RequestDeltaBatch(_message.Message):
    __slots__ = ("engine_id", "step", "request_ids", "num_new_tokens", "new_token_ids", "finish_reasons", "finished", "logprobs", "num_cached_tokens", "output_positions")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    step: int
    request_ids: bytes
    num_new_tokens: bytes
    new_token_ids: bytes
    finish_reasons: bytes
    finished: _containers.RepeatedCompositeFieldContainer[_common_pb2.FinishInfo]
    logprobs: _containers.RepeatedCompositeFieldContainer[RequestLogprobs]
    num_cached_tokens: bytes
    output_positions: bytes
    def __init__(self, engine_id: _Optional[str] = ..., step: _Optional[int] = ..., request_ids: _Optional[bytes] = ..., num_new_tokens: _Optional[bytes] = ..., new_token_ids: _Optional[bytes] = ..., finish_reasons: _Optional[bytes] = ..., finished: _Optional[_Iterable[_Union[_common_pb2.FinishInfo, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[RequestLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[bytes] = ..., output_positions: _Optional[bytes] = ...) -> None: ...

class RequestLogprobs(_message.Message):
    __slots__ = ("request_id", "is_prompt", "columns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IS_PROMPT_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    is_prompt: bool
    columns: _common_pb2.LogprobColumns
    def __init__(self, request_id: _Optional[str] = ..., is_prompt: _Optional[bool] = ..., columns: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("handle", "request_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens", "sampling", "lora", "mm_items")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    request_id: str
    token_ids: bytes
    num_prompt_tokens: int
    block_ids: bytes
    num_computed_tokens: int
    sampling: _common_pb2.SamplingParams
    lora: _common_pb2.LoraRequest
    mm_items: _containers.RepeatedCompositeFieldContainer[_common_pb2.MultiModalItem]
    def __init__(self, handle: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., num_prompt_tokens: _Optional[int] = ..., block_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lora: _Optional[_Union[_common_pb2.LoraRequest, _Mapping]] = ..., mm_items: _Optional[_Iterable[_Union[_common_pb2.MultiModalItem, _Mapping]]] = ...) -> None: ...

class StepInput(_message.Message):
    __slots__ = ("step", "new_requests", "cached_handles", "cached_num_new_blocks", "cached_new_block_ids", "cached_num_computed_tokens", "num_scheduled_tokens", "finished_handles", "reset", "kv_nodes", "kv_load_handles", "kv_load_num_blocks", "kv_load_block_ids", "kv_load_block_hashes", "kv_load_node_ids", "kv_save_ids", "kv_save_num_blocks", "kv_save_node_ids", "kv_save_before_forward", "kv_save_block_ids", "kv_save_block_hashes", "state_restore_handles", "state_restore_slots", "state_save_handles", "state_save_slots")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    KV_NODES_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_HANDLES_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_BEFORE_FORWARD_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STATE_RESTORE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    STATE_RESTORE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    cached_handles: bytes
    cached_num_new_blocks: bytes
    cached_new_block_ids: bytes
    cached_num_computed_tokens: bytes
    num_scheduled_tokens: bytes
    finished_handles: bytes
    reset: bool
    kv_nodes: bytes
    kv_load_handles: bytes
    kv_load_num_blocks: bytes
    kv_load_block_ids: bytes
    kv_load_block_hashes: bytes
    kv_load_node_ids: bytes
    kv_save_ids: bytes
    kv_save_num_blocks: bytes
    kv_save_node_ids: bytes
    kv_save_before_forward: bytes
    kv_save_block_ids: bytes
    kv_save_block_hashes: bytes
    state_restore_handles: bytes
    state_restore_slots: bytes
    state_save_handles: bytes
    state_save_slots: bytes
    def __init__(self, step: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., cached_handles: _Optional[bytes] = ..., cached_num_new_blocks: _Optional[bytes] = ..., cached_new_block_ids: _Optional[bytes] = ..., cached_num_computed_tokens: _Optional[bytes] = ..., num_scheduled_tokens: _Optional[bytes] = ..., finished_handles: _Optional[bytes] = ..., reset: _Optional[bool] = ..., kv_nodes: _Optional[bytes] = ..., kv_load_handles: _Optional[bytes] = ..., kv_load_num_blocks: _Optional[bytes] = ..., kv_load_block_ids: _Optional[bytes] = ..., kv_load_block_hashes: _Optional[bytes] = ..., kv_load_node_ids: _Optional[bytes] = ..., kv_save_ids: _Optional[bytes] = ..., kv_save_num_blocks: _Optional[bytes] = ..., kv_save_node_ids: _Optional[bytes] = ..., kv_save_before_forward: _Optional[bytes] = ..., kv_save_block_ids: _Optional[bytes] = ..., kv_save_block_hashes: _Optional[bytes] = ..., state_restore_handles: _Optional[bytes] = ..., state_restore_slots: _Optional[bytes] = ..., state_save_handles: _Optional[bytes] = ..., state_save_slots: _Optional[bytes] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("step", "handles", "sampled_token_ids", "logprob_handles", "logprobs", "prompt_logprobs", "error", "execute_s", "kv_loaded_handles", "kv_loaded_num_blocks", "kv_load_failed", "kv_saved_ids", "kv_save_failed", "rejected_handles", "rejected_reasons", "deferred_handles", "draft_handles", "num_draft_tokens", "worker_received_at", "worker_sent_at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_HANDLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_S_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_SAVED_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_FAILED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REASONS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    WORKER_SENT_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    handles: bytes
    sampled_token_ids: bytes
    logprob_handles: bytes
    logprobs: _common_pb2.LogprobColumns
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobChunk]
    error: str
    execute_s: float
    kv_loaded_handles: bytes
    kv_loaded_num_blocks: bytes
    kv_load_failed: bytes
    kv_saved_ids: bytes
    kv_save_failed: bytes
    rejected_handles: bytes
    rejected_reasons: bytes
    deferred_handles: bytes
    draft_handles: bytes
    num_draft_tokens: bytes
    worker_received_at: float
    worker_sent_at: float
    def __init__(self, step: _Optional[int] = ..., handles: _Optional[bytes] = ..., sampled_token_ids: _Optional[bytes] = ..., logprob_handles: _Optional[bytes] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobChunk, _Mapping]]] = ..., error: _Optional[str] = ..., execute_s: _Optional[float] = ..., kv_loaded_handles: _Optional[bytes] = ..., kv_loaded_num_blocks: _Optional[bytes] = ..., kv_load_failed: _Optional[bytes] = ..., kv_saved_ids: _Optional[bytes] = ..., kv_save_failed: _Optional[bytes] = ..., rejected_handles: _Optional[bytes] = ..., rejected_reasons: _Optional[bytes] = ..., deferred_handles: _Optional[bytes] = ..., draft_handles: _Optional[bytes] = ..., num_draft_tokens: _Optional[bytes] = ..., worker_received_at: _Optional[float] = ..., worker_sent_at: _Optional[float] = ...) -> None: ...

class PromptLogprobChunk(_message.Message):
    __slots__ = ("handle", "columns", "is_last_chunk")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    handle: int
    columns: _common_pb2.LogprobColumns
    is_last_chunk: bool
    def __init__(self, handle: _Optional[int] = ..., columns: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., is_last_chunk: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("engine_id", "worker_id", "num_blocks", "block_size", "max_model_len", "model", "vocab_size", "eos_token_ids", "incarnation", "kv_fingerprint", "max_loras", "max_cpu_loras", "host_id", "step_channel", "weight_version", "has_recurrent_state", "num_state_checkpoints")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_RECURRENT_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    worker_id: str
    num_blocks: int
    block_size: int
    max_model_len: int
    model: str
    vocab_size: int
    eos_token_ids: bytes
    incarnation: int
    kv_fingerprint: str
    max_loras: int
    max_cpu_loras: int
    host_id: str
    step_channel: str
    weight_version: str
    has_recurrent_state: bool
    num_state_checkpoints: int
    def __init__(self, engine_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[bytes] = ..., incarnation: _Optional[int] = ..., kv_fingerprint: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., host_id: _Optional[str] = ..., step_channel: _Optional[str] = ..., weight_version: _Optional[str] = ..., has_recurrent_state: _Optional[bool] = ..., num_state_checkpoints: _Optional[int] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
