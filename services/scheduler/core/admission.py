"""Whether a request may enter the engine: it must fit the model's context and the KV
cache (or it never runs), and the waiting queue must have room now (or the client retries)."""

from __future__ import annotations

from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.errors import AdmissionRejected, RequestTooLong
from services.scheduler.core.request import Request

# NOTE: a fixed hint; the queue drains at a rate the core does not measure.
RETRY_AFTER_S = 1.0


def check_fits(request: Request, max_model_len: int, block_size: int,
               num_usable_blocks: int) -> None:
    """Raises RequestTooLong when the request could never run here."""
    total = request.num_prompt_tokens + request.max_tokens
    if total > max_model_len:
        raise RequestTooLong(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {total} tokens ({request.num_prompt_tokens} in the messages, "
            f"{request.max_tokens} in the completion). Please reduce the length of the "
            f"messages or completion.")
    num_blocks = -(-total // block_size)
    if num_blocks > num_usable_blocks:
        raise RequestTooLong(
            f"The request needs {total} tokens of KV cache ({num_blocks} blocks) but the "
            f"engine holds {num_usable_blocks * block_size} tokens. Please reduce the length "
            f"of the messages or completion.")


def check_admission(request: Request, config: SchedulerConfig, num_waiting: int,
                    num_waiting_tokens: int) -> None:
    """Raises AdmissionRejected when the waiting queue is full right now."""
    max_reqs = config.max_num_queued_reqs
    if max_reqs is not None and num_waiting >= max_reqs:
        raise AdmissionRejected(f"the engine's waiting queue is full ({max_reqs} requests)",
                                RETRY_AFTER_S)
    max_tokens = config.max_num_queued_tokens
    # NOTE: an empty queue admits any one request, so a large prompt is not refused forever.
    if (max_tokens is not None and num_waiting_tokens > 0
            and num_waiting_tokens + request.num_tokens > max_tokens):
        raise AdmissionRejected(
            f"the engine's waiting queue is full ({num_waiting_tokens} tokens queued, "
            f"limit {max_tokens})", RETRY_AFTER_S)
