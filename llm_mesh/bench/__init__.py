"""`llm-mesh bench serve`: a load generator for any OpenAI-compatible server.

The pieces, in the order a run uses them:
    cli.py                options → one BenchmarkPoint per sweep value, then the report
    workloads.py          prompts of exact token lengths (random, shared-prefix, mixed, dataset)
    sessions.py           multi-turn: sessions sharing a system prompt, histories built from the
                          server's own answers, each turn after the last
    openai_client.py      one streamed request → RequestResult (httpx2, bodies pre-encoded)
    stream_parser.py      SSE bytes → first-token time, inter-chunk gaps, usage, errors
    runner.py             Poisson / bursty arrivals under an optional concurrency cap
    benchmark_metrics.py  percentiles, throughput, TPOT and goodput from the results
    report.py, plot.py    the printed tables, the JSON file, the throughput/interactivity PNG

Measured from the client side, as `vllm bench serve` does, so numbers compare across servers.
The comparison benchmarks behind docs/benchmarks.md (`benchmarks/` at the repository root)
are built on this package; it never imports them.
"""
