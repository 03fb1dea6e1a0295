"""The batch runner's settings: the shared request path's (API keys, rate limits, request
limits: it runs each batch's lines as the key that created the batch, limited as the gateway
limits the same body), and its own."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import setting
from services.frontend.settings import FrontendSettings


@dataclass
class BatchSettings(FrontendSettings):
    max_concurrent_lines: int = setting(
        32, "Most batch lines this runner keeps in the engines at once")
    batch_priority: int = setting(
        1000, "Priority of batch requests (lower runs first; interactive requests default to "
        "0): with the scheduler's --scheduling-policy priority, interactive traffic goes first")
    job_ack_wait_s: float = setting(
        30.0, "A job whose runner stops reporting for this long goes to another runner")
    line_retry_s: float = setting(
        600.0, "How long to retry a line the mesh cannot take now (no engine ready, queue "
        "full, engine lost) before recording it as failed")
