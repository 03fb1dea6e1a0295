"""The batch runner's settings: its own, and the gateway's API keys and rate limits (it runs
each batch's lines as the key that created the batch)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import CommonSettings, setting
from services.gateway.settings import TenantSettings


@dataclass
class BatchSettings(TenantSettings, CommonSettings):
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
    request_timeout_s: float = setting(600.0, "Longest a request may wait for its next token")
    instance_timeout_s: float = setting(
        3.5, "A service whose heartbeat is older than this is gone; its requests fail")
    tokenizer_timeout_s: float = setting(10.0, "Longest to wait for a tokenizer's answer")
