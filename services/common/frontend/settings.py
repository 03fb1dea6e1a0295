"""Settings of the request path, given to every service that serves OpenAI requests (the
gateway and the batch runner), so a batch line is validated and limited as the same body
POSTed to the gateway would be."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import CommonSettings, setting


@dataclass
class TenantSettings:
    """The API keys and their limits: the gateway's, and the batch runner's (which runs each
    batch's lines as the key that created it), so both must get the same values."""
    api_key: list[str] = setting([], "Accepted API keys (repeat the flag for several; none: "
                                 "no auth)", secret=True)
    admin_api_key: list[str] = setting(
        [], "API keys that may also call the admin endpoints (POST /reset_prefix_cache); with "
        "--api-key set and none of these, no key may", secret=True)
    rate_limit_tokens_per_minute: int = setting(
        0, "Per API key (all requests when no key is set): prompt + max_tokens tokens it may "
        "submit per minute, as a token bucket; beyond it 429 with Retry-After (0: no limit)")
    rate_limit_burst_tokens: int = setting(
        0, "Per API key: the token bucket's size, the most one burst may use (0: one "
        "minute's worth)")
    redis_url: str = setting(
        "", "Redis (or Valkey) URL holding the rate limits' token buckets, shared by every "
        "gateway replica and batch runner on it (empty: each process has its own)",
        secret=True)


@dataclass
class FrontendSettings(TenantSettings, CommonSettings):
    migration_timeout_s: float = setting(
        30.0, "How long a request whose engine or tokenizer was lost may look for live ones "
        "to continue on, before it fails with a retriable 503")
    max_n: int = setting(64, "Largest `n` (samples per prompt) accepted")
    max_logprobs: int = setting(20, "Largest number of top logprobs accepted")
    max_stop_strings: int = setting(64, "Most stop strings one request may set")
    request_timeout_s: float = setting(600.0, "Longest a request may wait for its next token")
    stall_timeout_s: float = setting(
        30.0, "Stall watchdog: a running request with no output this long, while its engine "
        "made no step progress (or is gone, or lost its worker), is moved to another engine "
        "(0: off)")
    sse_keepalive_s: float = setting(
        15.0, "A stream with nothing to send this long gets an SSE comment line "
        "(`: keep-alive`), so proxies with idle timeouts keep it open (0: off)")
    request_deadline_s: float = setting(
        0.0, "Longest a request may take from arrival to its last token (0: no deadline); a "
        "request may ask for less with the X-Request-Deadline-S header. Past it the engine "
        "ends the request within a step, frees its blocks, and the client gets a 504 "
        "deadline_exceeded")
    instance_timeout_s: float = setting(
        3.5, "A service whose heartbeat is older than this is gone; its requests fail")
    tokenizer_timeout_s: float = setting(10.0, "Longest to wait for a tokenizer's answer")
    enable_auto_tool_choice: bool = setting(
        True, "Let the model decide when to call tools (tool_choice \"auto\", the default "
        "with tools), parsing its calls with --tool-call-parser; off: \"auto\" is a 400")
    tool_call_parser: str = setting(
        "hermes", "How the model writes tool calls (vLLM's names): hermes (Qwen2/3 and the "
        "shipped tool-use template), llama3_json, mistral, pythonic",
        choices=["hermes", "llama3_json", "mistral", "pythonic"])
    reasoning_parser: str = setting(
        "", "Split <think> reasoning from the answer into reasoning_content (vLLM's names): "
        "deepseek_r1, qwen3; empty: off", choices=["", "deepseek_r1", "qwen3"])
