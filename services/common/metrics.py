"""Every Prometheus metric name of the mesh, in one place.

Engine metrics keep vLLM's names and types (`vllm:*`), so existing dashboards, KEDA
triggers and endpoint pickers work on the mesh unchanged; the mesh's own metrics are
`llm_mesh:*`. Histogram buckets are fine below 100 ms for latency SLOs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: fine steps below 100 ms, then coarser up to minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                   0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

# A local step's hops take tens of microseconds.
HOP_BUCKETS = (0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005,
               0.001, 0.002, 0.005, 0.01, 0.05)

ENGINE_LABELS = ("model_name", "engine")


class EngineMetrics:
    """The scheduler's view of its engine (vLLM's engine metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ENGINE_LABELS, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ENGINE_LABELS + extra, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ENGINE_LABELS, buckets=LATENCY_BUCKETS,
                             registry=registry)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Requests in the running batch")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc",
                                         "KV cache usage (1 = full)")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions (by recompute)")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.request_success = counter("vllm:request_success", "Finished requests",
                                       ("finished_reason",))
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Arrival at the engine to first token")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between consecutive output tokens")
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Arrival at the engine to finish")
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Arrival to first scheduled")
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "First scheduled to first token")
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "First token to last token")
        self.step_time = Histogram("llm_mesh:engine_step_seconds",
                                   "Wall time of one engine step (schedule, worker, update)",
                                   ENGINE_LABELS, buckets=STEP_BUCKETS, registry=registry)
        self.schedule_time = Histogram("llm_mesh:scheduler_cpu_seconds_per_step",
                                       "Scheduler time per step outside the worker call "
                                       "(schedule, encode, update, publish)",
                                       ENGINE_LABELS, buckets=STEP_BUCKETS, registry=registry)
        self.worker_call_time = Histogram("llm_mesh:worker_call_seconds",
                                          "Round trip of one step to the worker (transport, "
                                          "serialization and the forward pass)",
                                          ENGINE_LABELS, buckets=STEP_BUCKETS, registry=registry)
        self.worker_execute_time = Histogram("llm_mesh:worker_execute_seconds",
                                             "Worker time inside one step",
                                             ENGINE_LABELS, buckets=STEP_BUCKETS,
                                             registry=registry)
        self.step_messaging_time = Histogram(
            "llm_mesh:step_messaging_seconds",
            "Per step: worker round trip minus the worker's own time (the step transport and "
            "serialization)", ENGINE_LABELS, buckets=STEP_BUCKETS, registry=registry)
        self.step_hop_time = Histogram(
            "llm_mesh:step_hop_seconds",
            "Per step on the local channel, each hop of its messaging: to_worker (encode, "
            "write, the worker's read), worker (its decode and encode), back (the answer's "
            "write and read), to_loop (arrival until the event loop takes it up)",
            ENGINE_LABELS + ("hop",), buckets=HOP_BUCKETS, registry=registry)
        self.worker_step_transport = Gauge(
            "llm_mesh:worker_step_transport",
            "1 for how steps reach the worker now: local (a socket on this host) or nats",
            ENGINE_LABELS + ("transport",), registry=registry)
        self.prefill_token_cap = gauge(
            "llm_mesh:prefill_token_cap",
            "Prompt tokens a step beside running decodes may carry (--max-itl-factor on the "
            "fitted step time; the step budget while the guard is off or still learning)")
        self.admission_rejections = counter("llm_mesh:admission_rejections",
                                            "Requests refused because the queue was full")
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts",
                                              "Speculative decoding: requests' steps that "
                                              "verified drafts")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                                    "Draft tokens verified")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted")
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the step's drafts (0: the first)",
            ("position",))
        # KV connector (kvstore): vLLM's names for the external prefix cache, in tokens.
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the external (kvstore) prefix cache")
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens loaded from the external (kvstore) prefix cache")
        self.kv_load_failures = counter("llm_mesh:kv_load_failures",
                                        "KV loads from the kvstore that did not fully arrive "
                                        "intact (the rest was recomputed or the request failed)")
        self.kv_load_time = histogram("llm_mesh:kv_load_seconds",
                                      "A request's wait for its KV blocks from the kvstore")
        self.kv_saved_blocks = counter("llm_mesh:kv_saved_blocks",
                                       "KV blocks the kvstore acknowledged")
        self.kv_save_failures = counter("llm_mesh:kv_save_failures",
                                        "KV block groups the kvstore did not take (dropped)")
        self.kv_event_batches = gauge("llm_mesh:kv_event_batches",
                                      "KV event batches this engine has published (the last "
                                      "sequence number; --enable-kv-events)")


class GatewayMetrics:
    """Request-level metrics as clients see them, on the gateway's /metrics. vLLM's series
    are labelled by the engine that served the request, as each engine labels its own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, labels: tuple[str, ...] = ENGINE_LABELS) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Arrival at the gateway to first token")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between consecutive outputs of a request")
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Arrival at the gateway to last output")
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Time waiting in the engine before first scheduled")
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "First scheduled to first token, in the engine")
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "First token to last token, in the engine")
        # (Tokenizer times: before an engine is chosen, or not the engine's.)
        self.tokenize_time = histogram("llm_mesh:tokenize_seconds",
                                       "Gateway wait for a tokenizer to encode a prompt",
                                       ("model_name",))
        self.detokenize_time = histogram("llm_mesh:detokenize_seconds",
                                         "Tokenizer time spent detokenizing one request",
                                         ("model_name",))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests",
                                     ENGINE_LABELS, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                         ENGINE_LABELS, registry=registry)
        self.request_success = Counter("vllm:request_success", "Finished requests",
                                       ENGINE_LABELS + ("finished_reason",), registry=registry)
        self.rejections = Counter("llm_mesh:request_rejections",
                                  "Requests answered with an error before or while running",
                                  ("status", "code"), registry=registry)
        self.instances_started = Counter("llm_mesh:service_instances_started",
                                         "Service instances seen joining the mesh (restarts "
                                         "show up as new instances)", ("service",),
                                         registry=registry)
        self.instances_lost = Counter("llm_mesh:service_instances_lost",
                                      "Service instances whose heartbeat stopped",
                                      ("service",), registry=registry)
        self.request_migrations = Counter(
            "llm_mesh:request_migrations", "Running requests whose engine or tokenizer was "
            "lost: moved (continued elsewhere) or failed (no live one took over)",
            ("outcome",), registry=registry)
        self.engine_scrape_failures = Counter(
            "llm_mesh:engine_scrape_failures", "Scrapes of the gateway's /metrics that left "
            "an engine's own series out: its scheduler did not answer in time", ("engine",),
            registry=registry)
        self.request_stalls = Counter(
            "llm_mesh:request_stalls", "Running requests the stall watchdog moved: no output "
            "for --stall-timeout-s while their engine made no progress", registry=registry)
        self.router = RouterMetrics(registry)


class RouterMetrics:
    """The engine router's decisions and what it knows (services/common/frontend/
    engine_router.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "llm_mesh:router_decisions", "Requests routed, by why their engine was chosen: "
            "kv_overlap, least_loaded, round_robin, session, session_spill", ("reason",),
            registry=registry)
        self.predicted_cached_tokens = Counter(
            "llm_mesh:router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen engine to hold", registry=registry)
        self.actual_cached_tokens = Counter(
            "llm_mesh:router_actual_cached_tokens",
            "Prompt tokens the engines found cached, for the requests routed here",
            registry=registry)
        self.session_spills = Counter(
            "llm_mesh:router_session_spills", "Session requests sent away from their engine "
            "because it was past --router-session-busy-threshold, or queueing without most "
            "of their history", registry=registry)
        self.index_blocks = Gauge("llm_mesh:router_index_blocks",
                                  "Blocks in the router's prefix index", registry=registry)
        self.sessions = Gauge("llm_mesh:router_sessions", "Sessions the router keeps",
                              registry=registry)
        self.event_lag = Gauge("llm_mesh:router_kv_event_lag_seconds",
                               "Age of the last KV event batch when the router applied it",
                               registry=registry)
        self.resyncs = Counter("llm_mesh:router_kv_event_resyncs",
                               "Snapshots the router asked publishers for (gaps, late starts)",
                               registry=registry)
        self.applied_batches = Gauge(
            "llm_mesh:router_kv_event_batches_applied", "The last KV event batch applied per "
            "publisher: behind the publisher's llm_mesh:kv_event_batches, the index lags",
            ("publisher",), registry=registry)


class TokenizerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.encode_time = Histogram("llm_mesh:tokenizer_encode_seconds",
                                     "Time to render and encode one prompt",
                                     buckets=STEP_BUCKETS, registry=registry)
        self.delta_batch_time = Histogram("llm_mesh:tokenizer_step_seconds",
                                          "Time to detokenize one engine step's deltas and "
                                          "publish the text", buckets=STEP_BUCKETS,
                                          registry=registry)
        self.detokenizer_states = Gauge("llm_mesh:tokenizer_requests",
                                        "Requests holding detokenizer state here",
                                        registry=registry)


class GrammarMetrics:
    """Structured outputs' grammar compiles, on each service that compiles (the tokenizer
    validates at encode time; the worker compiles for its matchers)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.compiles = Counter("llm_mesh:grammar_compiles",
                                "Grammars compiled (cache misses, failed compiles included)",
                                registry=registry)
        self.cache_hits = Counter("llm_mesh:grammar_cache_hits",
                                  "Grammars found compiled (or compiling) in the cache",
                                  registry=registry)
        self.compile_time = Histogram("llm_mesh:grammar_compile_seconds",
                                      "Time to compile one grammar that compiled",
                                      buckets=LATENCY_BUCKETS, registry=registry)


class EncoderCacheMetrics:
    """The worker's encoder cache (issue 19): images looked up by content hash, and those
    found encoded already."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter("llm_mesh:encoder_cache_queries",
                               "Images looked up in the encoder cache", registry=registry)
        self.hits = Counter("llm_mesh:encoder_cache_hits",
                            "Images found in the encoder cache (not encoded again)",
                            registry=registry)


class KVStoreMetrics:
    """One kvstore node: its tiers and its data plane."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tier_bytes = Gauge("llm_mesh:kvstore_tier_bytes", "Bytes of KV blocks held",
                                ("tier",), registry=registry)
        self.tier_blocks = Gauge("llm_mesh:kvstore_tier_blocks", "KV blocks held", ("tier",),
                                 registry=registry)
        self.tier_capacity_bytes = Gauge("llm_mesh:kvstore_tier_capacity_bytes",
                                         "Configured bound of a tier", ("tier",),
                                         registry=registry)
        self.put_blocks = Counter("llm_mesh:kvstore_put_blocks", "Blocks stored by Put",
                                  registry=registry)
        self.put_bytes = Counter("llm_mesh:kvstore_put_bytes", "Payload bytes received by Put",
                                 registry=registry)
        self.rejected_blocks = Counter("llm_mesh:kvstore_rejected_blocks",
                                       "Blocks refused by Put (bad checksum, too large)",
                                       registry=registry)
        self.get_blocks = Counter("llm_mesh:kvstore_get_blocks", "Blocks served by Get",
                                  registry=registry)
        self.get_bytes = Counter("llm_mesh:kvstore_get_bytes", "Payload bytes served by Get",
                                 registry=registry)
        self.get_misses = Counter("llm_mesh:kvstore_get_misses",
                                  "Get calls that stopped at a block this node lacks",
                                  registry=registry)
        self.evicted_blocks = Counter("llm_mesh:kvstore_removed_blocks",
                                      "Blocks that left a tier (evicted, spilled or deleted)",
                                      registry=registry)
