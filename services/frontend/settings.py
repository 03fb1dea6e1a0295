"""Settings of the request path, given to every service that serves OpenAI requests (the
gateway and the batch runner), so a batch line is validated and limited as the same body
POSTed to the gateway would be."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import CommonSettings, LivenessSettings, setting
from services.frontend.openai.lora_registry import parse_lora_module


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
class RouterSettings:
    """How the gateway picks an engine (services/frontend/router/engine_router.py)."""
    router_mode: str = setting(
        "kv", "kv: by the prompt blocks each engine holds against its load; least-loaded; "
        "round-robin", choices=["kv", "least-loaded", "round-robin"])
    kv_overlap_score_weight: float = setting(
        1.0, "KV router: the weight of prefill blocks (those an engine would compute) against "
        "its decode blocks in an engine's cost; higher favours cache hits over balance")
    router_temperature: float = setting(
        0.0, "KV router: 0 takes the cheapest engine; above 0 samples engines by "
        "softmax(-cost / temperature), spreading load at some cost in hits")
    router_kv_events: bool = setting(
        True, "KV router: follow the KV events of engines that publish them (schedulers with "
        "--enable-kv-events); off, or for engines that do not, predict what each holds from "
        "the router's own decisions")
    router_ttl_s: float = setting(
        120.0, "KV router: how long a predicted block (no KV events) counts as held")
    router_session_busy_threshold: float = setting(
        0.9, "An engine whose KV cache is this full (0..1) is busy: a session "
        "(prompt_cache_key or x-session-id) spills from it to another engine, and queued "
        "requests do not move onto it")
    router_session_history_weight: float = setting(
        1.0, "KV router: the weight, in a new session's cost, of the history blocks of the "
        "live sessions each engine holds (their last prompts): what they will come back "
        "for. Above 1 counts on their histories growing; 0 places new sessions by load and "
        "cache alone")
    router_session_ttl_s: float = setting(
        3600.0, "How long a session remembers its engine after its last request")
    router_queue_move_after_s: float = setting(
        15.0, "A request still waiting for its first token this long on an engine with a "
        "queue moves to an engine with none and KV room (below the busy threshold) where its "
        "prefill would end sooner (queued tokens plus the prompt tokens it lacks); 0: never")
    router_hash_algo: str = setting(
        "sha256", "Block hash of the prefix index; must equal the schedulers' "
        "--prefix-caching-hash-algo", choices=["sha256", "xxh3_128"])


@dataclass
class FrontendSettings(RouterSettings, TenantSettings, LivenessSettings, CommonSettings):
    migration_timeout_s: float = setting(
        30.0, "How long a request whose engine or tokenizer was lost may look for live ones "
        "to continue on, before it fails with a retriable 503")
    lora_modules: list[str] = setting(
        [], "LoRA adapters served by model name, name=path (a PEFT directory the engines' "
        "workers can read) or vLLM's JSON {\"name\", \"path\", \"base_model_name\"}; "
        "repeat the flag for several. Engines need --enable-lora")
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
    engine_wait_s: float = setting(
        10.0, "A request arriving while no engine is ready (one starting or restarting, a "
        "heartbeat late) waits this long for one before its 503")
    tokenizer_timeout_s: float = setting(10.0, "Longest to wait for a tokenizer's answer")
    engine_submit_timeout_s: float = setting(
        10.0, "Longest to wait for a scheduler to accept (or refuse) a request, or to answer "
        "an admin command")
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

    def __post_init__(self) -> None:
        super().__post_init__()
        for spec in self.lora_modules:   # a bad flag stops the start
            parse_lora_module(spec)
