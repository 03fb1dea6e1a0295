"""The body of `POST /v1/responses`: OpenAI's fields, unknown ones ignored (the Agents SDK
sends several that change nothing here), what cannot be honoured refused in validation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.frontend.openai.protocol import MAX_SESSION_ID_CHARS


class InputContentPart(BaseModel):
    """A part of a message's content: `input_text`, or `output_text` of an earlier answer;
    anything else (images, files, audio) is refused when the message is converted."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class InputItem(BaseModel):
    """One item of `input`: a message (`type` "message" or absent, with a role), a
    `function_call` the model made earlier, or the `function_call_output` answering it.
    Reasoning items and item references are accepted and skipped (nothing to replay)."""
    model_config = ConfigDict(extra="ignore")
    type: str = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None


class FunctionTool(BaseModel):
    """A tool of the Responses API: a function, described flat (chat nests it)."""
    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions = Field(default_factory=TextOptions)
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)   # vLLM's extra, as in chat
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=MAX_SESSION_ID_CHARS)
    truncation: Literal["auto", "disabled"] | None = None
