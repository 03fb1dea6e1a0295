"""Stop conditions, checked per output token: EOS, stop token ids, max_tokens, max_model_len."""

from __future__ import annotations

from services.scheduler.core.request import Request, RequestStatus


def append_output_tokens(request: Request, token_ids: list[int], max_model_len: int
                         ) -> tuple[list[int], RequestStatus | None]:
    """Appends tokens up to the first that stops the request (tokens a step sampled past it,
    verifying drafts, are dropped); returns those appended and the stop, if any."""
    for i, token_id in enumerate(token_ids):
        request.append_output_token_id(token_id)
        status = check_stop(request, token_id, max_model_len)
        if status is not None:
            return token_ids[:i + 1], status
    return token_ids, None


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """How `request` ends now that `token_id` is its last output (None: it goes on)."""
    num_output_tokens = len(request.output_token_ids)
    if token_id in request.stop_ids and num_output_tokens >= request.min_tokens:
        # As in vLLM, stop_token_id names an explicit stop token, not EOS.
        if token_id in request.stop_token_ids:
            request.stop_token_id = token_id
        return RequestStatus.FINISHED_STOPPED
    if (num_output_tokens >= request.max_tokens
            or request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
