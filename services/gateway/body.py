"""Reading a JSON request body: bounded in size, valid JSON and Unicode, validated against
its pydantic model; every failure is an OpenAI-style 400 (413 past the size limit)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.common.json_depth import MAX_BODY_DEPTH, nesting_depth
from services.frontend.errors import ApiError, invalid

M = TypeVar("M", bound=BaseModel)

async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"request body is larger than {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    if nesting_depth(data, stop_past=MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
        # NOTE: before validation, which (like the surrogate check) recurses per level.
        raise _too_deep()
    if b"\\ud" in raw.lower() and _has_lone_surrogate(data):
        # NOTE: JSON may escape half a UTF-16 pair ("\ud800"); such text cannot be encoded
        # as UTF-8, so no tokenizer and no protobuf message could carry it.
        raise invalid("the request body holds a lone UTF-16 surrogate (invalid Unicode)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise invalid(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


def _too_deep() -> ApiError:
    return invalid(f"the request body nests JSON deeper than {MAX_BODY_DEPTH} levels")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False
