"""Request bodies of the OpenAI-compatible API (plus vLLM's extra sampling fields).

Unknown fields are ignored, as vLLM does, so clients that send newer fields keep working;
fields we cannot honour yet (e.g. `suffix`, tools) are refused with a 400 in validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Values that travel as int32 on the wire: out of range is a 400 here, not an overflow later.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Stop = str | list[str] | None
MAX_SESSION_ID_CHARS = 256   # prompt_cache_key / x-session-id: the router keeps each one


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema. `strict` and `description` are ignored: the
    schema is always enforced (what cannot be enforced is refused)."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(max_length=64)
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag, in vLLM's two spellings: xgrammar's `format`, or the older
    # `structures` ({begin, schema, end} objects) with their `triggers`.
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: one constraint at a time. Unknown keys are refused, so a
    misspelt constraint is a 400, not a silently unconstrained output."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_switches_that_change_nothing(cls, data: Any) -> Any:
        # NOTE: vLLM's disable_fallback and disable_additional_properties: xgrammar is the
        # only backend (nothing to fall back to), and it already refuses properties a schema
        # does not name.
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if k not in ("disable_fallback", "disable_additional_properties")}
        return data


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    # OpenAI's name for a conversation's cache key: the router keeps it on one engine.
    prompt_cache_key: str | None = Field(None, max_length=MAX_SESSION_ID_CHARS)
    prompt_logprobs: int | None = Field(None, ge=0, le=2**31 - 1)
    # vLLM's: the prompt's token ids and each choice's output ids beside the text (a streamed
    # chunk carries its delta's ids), so a trainer needs no re-tokenizing.
    return_token_ids: bool | None = None
    # Structured outputs (services/frontend/openai/grammar_request.py): OpenAI's field,
    # vLLM's, and vLLM's older guided_* spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: Stop) -> Stop:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=2**31 - 1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=2**31 - 1)
    best_of: int | None = Field(None, ge=1, le=2**31 - 1)
    suffix: str | None = None
    add_special_tokens: bool = True


class ImageUrlRef(BaseModel):
    """An `image_url` part's object; the tokenizer fetches and checks it (its `param` in
    errors names the part)."""
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: str | None = None


class ContentPart(BaseModel):
    """A chat message's content part: `text`, or `image_url` (a data:, http(s) or file://
    URL, fetched by the tokenizer under its allow-lists)."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    image_url: ImageUrlRef | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionCall | dict[str, str]

    @property
    def name(self) -> str:
        function = self.function
        return function.name if isinstance(function, FunctionCall) else function.get("name", "")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string; ValueError for a part that is not text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported; "
                                 f"send text or image_url parts")
            texts.append(part.text or "")
        return "".join(texts)

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            part.type == "image_url" for part in self.content)

    def parts(self) -> list[dict[str, Any]]:
        """The content list as OpenAI's JSON parts, in order (a message with images);
        ValueError for a part that is neither text nor an image."""
        assert isinstance(self.content, list)
        parts: list[dict[str, Any]] = []
        for part in self.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            elif part.type == "image_url" and part.image_url is not None:
                parts.append({"type": "image_url",
                              "image_url": part.image_url.model_dump(exclude_none=True)})
            elif part.type == "image_url":
                raise ValueError("an image_url part needs an image_url object with a url")
            else:
                raise ValueError(f"content part type {part.type!r} is not supported; "
                                 f"send text or image_url parts")
        return parts


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=2**31 - 1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId]
