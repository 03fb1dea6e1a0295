"""`llm-mesh bench serve`: options, the sweep loop, and the outputs.

    llm-mesh bench serve --base-url http://127.0.0.1:8000 --workload random \
        --input-len 256 --output-len 128 --num-prompts 200 --ignore-eos \
        --sweep 1,4,16,inf --goodput ttft:500 tpot:50 --result-json r.json --plot r.png

    llm-mesh bench serve --workload multi-turn --num-sessions 32 --turns-per-session 8 \
        --system-prompt-len 1024 --turn-input-len 64 --output-len 32 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics, compute_metrics, parse_slos
from llm_mesh.bench.openai_client import (
    ENDPOINT_PATHS,
    TRANSPORTS,
    OpenAIClient,
    SamplingOptions,
    encode_body,
)
from llm_mesh.bench.plot import write_plot
from llm_mesh.bench.report import build_json, format_detail, format_sweep, write_json
from llm_mesh.bench.runner import BenchmarkPoint, RunResult, run_point
from llm_mesh.bench.sessions import MultiTurnOptions, build_conversations, run_sessions
from llm_mesh.bench.stream_parser import RequestResult
from llm_mesh.bench.workloads import (
    WORKLOADS,
    PromptBuilder,
    WorkloadOptions,
    build_requests,
    load_tokenizer,
    read_jsonl,
)

USAGE = "llm-mesh bench serve [options]   (llm-mesh bench serve --help lists them)"
DEFAULT_NUM_PROMPTS = 100
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from every measured point's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-mesh bench serve",
                                description="Load-test an OpenAI-compatible server.")
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000")
    server.add_argument("--model", help="default: the first id of GET /v1/models")
    server.add_argument("--lora-modules", nargs="+", metavar="NAME", default=[],
                        help="LoRA adapters (served model names) the requests are spread "
                        "over, in turn (not multi-turn)")
    server.add_argument("--endpoint", choices=tuple(ENDPOINT_PATHS),
                        help="default: completions (multi-turn: chat, its only endpoint)")
    server.add_argument("--api-key", help="sent as a bearer token")
    server.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    server.add_argument("--http-client", choices=tuple(TRANSPORTS), default="raw",
                        help="raw: cheapest per chunk (default); httpx2: a full HTTP client")
    load = p.add_argument_group("workload")
    load.add_argument("--workload", choices=WORKLOADS, default="random")
    load.add_argument("--dataset", type=Path, help="JSONL: {prompt, output_len} or {messages}")
    load.add_argument("--tokenizer", help="local tokenizer dir (default: the embedded model's)")
    load.add_argument("--num-prompts", type=int,
                      help=f"per sweep point (default {DEFAULT_NUM_PROMPTS}; dataset: its size)")
    load.add_argument("--input-len", type=int, default=256)
    load.add_argument("--output-len", type=int, help="default 128 (multi-turn: 32)")
    load.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix")
    load.add_argument("--suffix-len", type=int, default=32, help="shared-prefix")
    load.add_argument("--long-input-len", type=int, default=2000, help="mixed")
    load.add_argument("--long-fraction", type=float, default=0.1, help="mixed")
    load.add_argument("--num-sessions", type=int, default=16,
                      help="multi-turn: sessions per sweep point (instead of --num-prompts)")
    load.add_argument("--turns-per-session", type=int, default=6, help="multi-turn")
    load.add_argument("--system-prompt-len", type=int, default=1024,
                      help="multi-turn: the tools/system prompt every session shares")
    load.add_argument("--turn-input-len", type=int, default=64,
                      help="multi-turn: new user tokens per turn")
    load.add_argument("--think-time", type=float, default=0.0,
                      help="multi-turn: mean seconds between an answer and the session's "
                           "next turn (exponential; an agent's tool calls)")
    load.add_argument("--no-session-hints", action="store_true",
                      help="multi-turn: send neither prompt_cache_key nor x-session-id")
    load.add_argument("--ignore-eos", action="store_true", help="exact output lengths (vLLM)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--extra-body", type=json.loads, default={},
                      help='JSON merged into every request body (vLLM\'s flag), e.g. '
                           '\'{"response_format": {"type": "json_object"}}\'')
    load.add_argument("--seed", type=int, default=0)
    traffic = p.add_argument_group("traffic")
    traffic.add_argument("--request-rate", type=float, default=math.inf,
                         help="requests/s (multi-turn: sessions/s), Poisson arrivals; "
                              "inf sends all at once")
    traffic.add_argument("--burstiness", type=float, default=1.0,
                         help="gamma shape of arrivals: 1 = Poisson, <1 burstier")
    traffic.add_argument("--max-concurrency", type=int,
                         help="cap on requests in flight (multi-turn: on sessions)")
    traffic.add_argument("--sweep", help='comma list, e.g. "1,2,4,8,inf": one run per value')
    traffic.add_argument("--sweep-by", choices=("rate", "concurrency"), default="rate",
                         help="what --sweep varies (default: the request rate)")
    traffic.add_argument("--warmup", type=int, default=0, help="requests sent before measuring")
    out = p.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    out.add_argument("--result-json", type=Path)
    out.add_argument("--save-detailed", action="store_true", help="per-request rows in JSON")
    out.add_argument("--plot", type=Path, help="PNG: throughput per device vs interactivity")
    out.add_argument("--num-devices", type=int, default=1, help="divides throughput (per GPU/CPU)")
    out.add_argument("--no-progress", action="store_true")
    return p


def sweep_points(args: argparse.Namespace) -> list[BenchmarkPoint]:
    if not args.sweep:
        return [BenchmarkPoint(args.request_rate, args.max_concurrency)]
    values = [float(v) for v in args.sweep.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--sweep {args.sweep!r}: values must be positive (or inf)")
    if args.sweep_by == "rate":
        return [BenchmarkPoint(v, args.max_concurrency) for v in values]
    return [BenchmarkPoint(args.request_rate, None if math.isinf(v) else int(v)) for v in values]


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fills the defaults that depend on the workload; refuses what multi-turn cannot do."""
    if args.output_len is None:  # an agent's turns answer briefly: mostly prefill
        args.output_len = 32 if args.workload == "multi-turn" else 128
    if args.workload != "multi-turn":
        args.endpoint = args.endpoint or "completions"
        return
    if args.endpoint == "completions":
        raise ValueError("--workload multi-turn sends chat messages: use --endpoint chat")
    if args.num_prompts is not None:
        raise ValueError("--workload multi-turn counts --num-sessions x --turns-per-session, "
                         "not --num-prompts")
    if args.num_sessions < 1 or args.turns_per_session < 1:
        raise ValueError("--num-sessions and --turns-per-session must be at least 1")
    if args.think_time < 0:
        raise ValueError("--think-time must not be negative")
    args.endpoint = "chat"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args[0] != "serve":
        print(f"unknown bench command {args[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    parser = build_parser()
    options = parser.parse_args(args[1:])
    try:
        resolve_defaults(options)
        points = sweep_points(options)
        slos = parse_slos(options.goodput)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return _run(bench_serve(options, points, slos))
    except (OSError, ValueError) as exc:  # a bad --tokenizer or --dataset: one line, no trace
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run(coro: Any) -> int:
    try:
        import uvloop  # NOTE: a faster loop keeps the client's own CPU cost down
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


async def bench_serve(args: argparse.Namespace, points: list[BenchmarkPoint],
                      slos: dict[str, float]) -> int:
    started = time.time()
    builder = PromptBuilder(load_tokenizer(args.tokenizer))
    workload: WorkloadOptions | MultiTurnOptions
    if args.workload == "multi-turn":
        workload = MultiTurnOptions(
            turns_per_session=args.turns_per_session, system_prompt_len=args.system_prompt_len,
            turn_input_len=args.turn_input_len, output_len=args.output_len,
            session_hints=not args.no_session_hints, think_time_s=args.think_time)
        count = args.num_sessions  # one arrival per session
        num_prompts = count * args.turns_per_session
        per_point = f"{count} sessions x {args.turns_per_session} turns"
    else:
        workload = WorkloadOptions(
            kind=args.workload, is_chat=args.endpoint == "chat", input_len=args.input_len,
            output_len=args.output_len, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            long_input_len=args.long_input_len, long_fraction=args.long_fraction,
            dataset=args.dataset)
        count = num_prompts = args.num_prompts or _default_num_prompts(workload)
        per_point = f"{num_prompts} prompts"
    caps = [p.max_concurrency for p in points]
    pool = count if None in caps else min(max(caps), count)  # type: ignore[type-var]
    sampling = SamplingOptions(args.temperature, args.ignore_eos, args.extra_body)
    metrics: list[BenchmarkMetrics] = []
    details: list[list[RequestResult]] = []
    async with OpenAIClient(args.base_url, args.endpoint, args.api_key,
                            max(pool, args.warmup, 1), args.timeout,
                            args.http_client) as client:
        try:
            model = args.model or await client.first_model()
        except Exception as exc:  # noqa: BLE001 — a clear line, not a traceback
            print(f"error: cannot list the models at {args.base_url}: {exc!r}", file=sys.stderr)
            return 1
        encode = partial(encode_body, model=model, endpoint=args.endpoint, sampling=sampling)

        async def measure(options: WorkloadOptions | MultiTurnOptions, num: int, seed: int,
                          point: BenchmarkPoint, show_progress: bool) -> RunResult:
            """`num` prompts, or sessions for multi-turn, of the workload, seeded."""
            if isinstance(options, MultiTurnOptions):
                return await run_sessions(client, build_conversations(options, builder, num, seed),
                                          encode, point, args.burstiness, seed, show_progress)
            models = args.lora_modules or [model]
            requests = [encode(s, model=models[i % len(models)])
                        for i, s in enumerate(build_requests(options, builder, num, seed))]
            return await run_point(client, requests, point, args.burstiness, seed,
                                   show_progress)

        print(f"benchmarking {model} at {args.base_url} ({args.endpoint}, {args.workload}, "
              f"{per_point} per point)", file=sys.stderr)
        if args.warmup:
            # A warm-up session is one turn: --warmup counts requests for every workload.
            warm = (replace(workload, turns_per_session=1)
                    if isinstance(workload, MultiTurnOptions) else workload)
            run = await measure(warm, args.warmup, args.seed + WARMUP_SEED_OFFSET,
                                BenchmarkPoint(math.inf, points[0].max_concurrency), False)
            print(f"warm-up: {sum(r.success for r in run.results)}/{args.warmup} succeeded",
                  file=sys.stderr)
        for i, point in enumerate(points):
            # Fresh prompts per point: a prefix cache must not serve one point from another.
            run = await measure(workload, count, args.seed + i, point, not args.no_progress)
            metrics.append(compute_metrics(run, slos))
            details.append(run.results)
            print(format_detail(metrics[-1], args.num_devices))
            _warn_if_client_bound(run.client_cpu_s, run.duration_s)
    if len(metrics) > 1:
        print(format_sweep(metrics, args.num_devices))
    config = _config(args, model, num_prompts, slos, started)
    if args.result_json:
        write_json(args.result_json,
                   build_json(config, metrics, details if args.save_detailed else None))
        print(f"wrote {args.result_json}", file=sys.stderr)
    if args.plot:
        write_plot(args.plot, {model: metrics}, args.num_devices,
                   title=f"{model}: {args.workload} {_shape(args)}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(m.completed for m in metrics) else 1


def _shape(args: argparse.Namespace) -> str:
    """Prompt/output tokens, as a plot title gives them."""
    if args.workload == "multi-turn":
        return (f"{args.system_prompt_len}+{args.turns_per_session}x{args.turn_input_len}"
                f"/{args.output_len}")
    return f"{args.input_len}/{args.output_len}"


def _default_num_prompts(workload: WorkloadOptions) -> int:
    if workload.kind == "dataset" and workload.dataset is not None:
        return len(read_jsonl(workload.dataset))
    return DEFAULT_NUM_PROMPTS


def _warn_if_client_bound(cpu_s: float, duration_s: float) -> None:
    share = cpu_s / max(duration_s, 1e-9)
    if share > 0.5:
        print(f"warning: the benchmark client used {share:.0%} of a core; on a small machine "
              f"it may be slowing the server it measures", file=sys.stderr)


def _config(args: argparse.Namespace, model: str, num_prompts: int, slos: dict[str, float],
            started: float) -> dict[str, Any]:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if config.get("api_key"):
        config["api_key"] = "***"  # NOTE: result files get shared; keys must not travel
    config.update(model=model, num_prompts=num_prompts, goodput=slos or None,
                  started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)))
    return config
