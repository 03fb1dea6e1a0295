from services.common.wire_pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls_json", "tool_call_id", "content_parts_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls_json: str
    tool_call_id: str
    content_parts_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., content_parts_json: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class DetokenizeParams(_message.Message):
    __slots__ = ("stop", "include_stop_str_in_output", "skip_special_tokens", "gateway_id", "engine_id", "return_token_strings", "min_tokens")
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    gateway_id: str
    engine_id: str
    return_token_strings: bool
    min_tokens: int
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., gateway_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., return_token_strings: _Optional[bool] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("prompt", "chat", "prompt_token_ids", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "request_ids", "detokenize", "chat_template_kwargs_json", "return_token_strings", "resume_token_ids", "resume_num_chars", "grammar", "tools_json")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_NUM_CHARS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    chat: ChatMessages
    prompt_token_ids: bytes
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    chat_template: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    detokenize: DetokenizeParams
    chat_template_kwargs_json: str
    return_token_strings: bool
    resume_token_ids: bytes
    resume_num_chars: int
    grammar: _common_pb2.GrammarSpec
    tools_json: str
    def __init__(self, prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[bytes] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., chat_template: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., detokenize: _Optional[_Union[DetokenizeParams, _Mapping]] = ..., chat_template_kwargs_json: _Optional[str] = ..., return_token_strings: _Optional[bool] = ..., resume_token_ids: _Optional[bytes] = ..., resume_num_chars: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.GrammarSpec, _Mapping]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("token_ids", "tokenizer_id", "error", "token_strings", "grammar_error", "grammar", "mm_items", "error_param")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ERROR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_PARAM_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    tokenizer_id: str
    error: str
    token_strings: _containers.RepeatedScalarFieldContainer[str]
    grammar_error: str
    grammar: _common_pb2.GrammarSpec
    mm_items: _containers.RepeatedCompositeFieldContainer[_common_pb2.MultiModalItem]
    error_param: str
    def __init__(self, token_ids: _Optional[bytes] = ..., tokenizer_id: _Optional[str] = ..., error: _Optional[str] = ..., token_strings: _Optional[_Iterable[str]] = ..., grammar_error: _Optional[str] = ..., grammar: _Optional[_Union[_common_pb2.GrammarSpec, _Mapping]] = ..., mm_items: _Optional[_Iterable[_Union[_common_pb2.MultiModalItem, _Mapping]]] = ..., error_param: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[bytes] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeReply(_message.Message):
    __slots__ = ("text", "error")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    text: str
    error: str
    def __init__(self, text: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TextOutputBatch(_message.Message):
    __slots__ = ("request_ids", "texts", "num_new_tokens", "finish_reasons", "finished", "logprobs", "token_ids", "output_positions")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    request_ids: bytes
    texts: bytes
    num_new_tokens: bytes
    finish_reasons: bytes
    finished: _containers.RepeatedCompositeFieldContainer[_common_pb2.FinishInfo]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    token_ids: bytes
    output_positions: bytes
    def __init__(self, request_ids: _Optional[bytes] = ..., texts: _Optional[bytes] = ..., num_new_tokens: _Optional[bytes] = ..., finish_reasons: _Optional[bytes] = ..., finished: _Optional[_Iterable[_Union[_common_pb2.FinishInfo, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., token_ids: _Optional[bytes] = ..., output_positions: _Optional[bytes] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("request_id", "is_prompt", "columns", "token_strings", "top_token_strings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IS_PROMPT_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    is_prompt: bool
    columns: _common_pb2.LogprobColumns
    token_strings: bytes
    top_token_strings: bytes
    def __init__(self, request_id: _Optional[str] = ..., is_prompt: _Optional[bool] = ..., columns: _Optional[_Union[_common_pb2.LogprobColumns, _Mapping]] = ..., token_strings: _Optional[bytes] = ..., top_token_strings: _Optional[bytes] = ...) -> None: ...
