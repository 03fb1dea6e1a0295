"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
    503: "service_unavailable", 504: "timeout_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": _TYPE_BY_STATUS.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def deadline_exceeded() -> ApiError:
    """The request's deadline (--request-deadline-s, or its X-Request-Deadline-S header)
    passed before it finished; the engine ended it and freed its blocks."""
    return ApiError(504, "the request's deadline passed before it finished",
                    code="deadline_exceeded")


def unavailable(message: str, code: str = "service_unavailable",
                retry_after_s: float = 1.0) -> ApiError:
    return ApiError(503, message, code=code, retry_after_s=retry_after_s)


def context_length_exceeded(max_model_len: int, num_prompt_tokens: int, max_tokens: int,
                            param: str) -> ApiError:
    # NOTE: vLLM's wording; clients (LangChain, litellm) match on it.
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
        f"messages, {max_tokens} in the completion). Please reduce the length of the "
        f"messages or completion.",
        param=param, code="context_length_exceeded")
