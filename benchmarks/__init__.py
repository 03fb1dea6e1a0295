"""The comparison benchmarks behind docs/benchmarks.md, each run from the repository root as
`python -m benchmarks.<name> [--help]`:

    vs_hf         the mesh against HF transformers on one workload (runs hf, then mesh)
    hf            HF `generate` baselines (static and continuous batching), in-process
    mesh          `llm-mesh up` per configuration, `llm-mesh bench serve` against each
    engine_core.sh  issue 3's prefix-caching and chunked-prefill comparisons (mesh, 3 runs)
    other_server  `llm-mesh bench serve` against `transformers serve` / llama.cpp, then the mesh
    runner        the worker's ModelRunner in-process: step time, its phases, prefill
    scheduler     the scheduler's CPU time per step with a fake executor
    kvstore       TTFT loaded from the kvstore vs recomputed; the gRPC data plane
    batch         batch jobs against interactive latency
    rate_limit    a token bucket's charge in-process vs in Redis

`harness.py` holds what they share (servers under test, `llm-mesh bench serve` runs,
percentiles, tables, the machine's name). The user-facing load generator is `llm-mesh bench`
(`llm_mesh/bench/`); benchmarks import it, never the reverse.
"""
