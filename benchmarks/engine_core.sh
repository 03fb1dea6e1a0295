#!/usr/bin/env bash
# Issue 3's engine-core figures through the whole mesh, each comparison in one mesh-per-config
# run of benchmarks/mesh.py (results under ${OUT:-bench-results/engine-core}):
#   (a) a shared 1,024-token prefix + 32-token questions: TTFT with prefix caching on vs off
#       (off also turns the kvstore connector off, or the store would serve the prefix);
#   (b) mixed load (10% of prompts 2,000 tokens among 128/128 streams): ITL with chunked
#       prefill at budget 512 and 2048 vs no chunking (a budget above the longest prompt);
#   (c) prefix caching on vs off at a 0% hit rate (random prompts): throughput.
# Scheduler CPU time per step is benchmarks/scheduler.py (no mesh needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-results/engine-core}
NO_CACHE="--no-enable-prefix-caching --no-enable-kv-connector"

$PY -m benchmarks.mesh --out "$OUT/a" \
  --config "cache-on=" --config "cache-off=$NO_CACHE" \
  --bench "--workload shared-prefix --prefix-len 1024 --suffix-len 32 --output-len 16 \
           --max-concurrency 1 --num-prompts 16 --warmup 1"

$PY -m benchmarks.mesh --out "$OUT/b" \
  --config "budget512=--max-num-batched-tokens 512" \
  --config "budget2048=--max-num-batched-tokens 2048" \
  --config "no-chunking=--max-num-batched-tokens 8192 --max-model-len 8192" \
  --bench "--workload mixed --long-input-len 2000 --long-fraction 0.1 --input-len 128 \
           --output-len 128 --ignore-eos --max-concurrency 16 --num-prompts 48 --warmup 1"

$PY -m benchmarks.mesh --out "$OUT/c" \
  --config "cache-on=--no-enable-kv-connector" --config "cache-off=$NO_CACHE" \
  --bench "--workload random --input-len 128 --output-len 128 --ignore-eos \
           --max-concurrency 32 --num-prompts 64 --warmup 1"
