#!/usr/bin/env bash
# The GPU check (issues 4 and 45): one prepared script for a lent accelerator.
#
#   bash scripts/gpu_check.sh [--cpu-dry-run] [STAGE...]
#
# Stages (default: device kernels cuda-graphs tp mesh vllm):
#   device       the GPU, torch / triton / transformers, and that every service imports
#   kernels      tests/kernels and the attention adapter's tests with KERNEL_TEST_DEVICE=cuda:
#                every Triton kernel the product can launch, compiled for the GPU (paged KV
#                write, decode with and without KV splits, prefill, fp8, windows and caps,
#                fused MoE, LoRA, W4A16, the layer ops and tiny models on them, the triton
#                attention adapter with bf16 dots); nothing deselected
#   cuda-graphs  tests/worker/test_cuda_graphs.py: graph replays give eager's greedy tokens
#   tp           two GPUs or more: tensor parallel 2 against HF over NCCL, every kernel case
#                on the second GPU, the TP=2 / TP=1 step time; skipped with one GPU
#   mesh         the whole mesh end to end (`llm-mesh up`), random weights in SmolLM2-135M's
#                and in Llama-3-8B's shape with the embedded tokenizer, built on the device
#                (benchmarks/random_checkpoint.py): `llm-mesh bench serve` at concurrency
#                1/8/32/128, 256-token prompts, 128 tokens out: TTFT, TPOT, tok/s
#   vllm         if the image has vLLM (pip list), the same benches against it, same weights
#   runner       (only when named) the worker alone: decode step time bf16 / fp32, batch
#                1..256, and the profiler's kernel table (benchmarks/runner.py)
#
# Before, on a machine with registries: bash scripts/gpu_prepare.sh (the wheels the image
# lacks into .whl/, the tokenizer files into .gpu/tokenizer/); the device call carries both:
#   carry [".whl", ".gpu"]. A device command runs 10 minutes at most, so two calls:
#   bash scripts/gpu_check.sh device kernels cuda-graphs tp
#   bash scripts/gpu_check.sh device mesh vllm
# --cpu-dry-run proves the plumbing on a machine without a GPU: kernels under the Triton
# interpreter, the CUDA-graph test skipped, tensor parallel over gloo, the mesh on a tiny
# model of the same files at concurrency 1 and 4, vLLM looked for the same way.
#
# Each stage ends with a line PASS, FAIL or SKIP and its figures; a failing stage does not
# stop the next; the summary closes the output (and is $OUT/summary.txt; every log is in
# $OUT/logs.tar.gz). Exit status 1 if a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench-results/gpu}
WORK=${WORK:-/tmp/gpu-check}
DRY_RUN=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
  DRY_RUN=1
  shift
fi
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(device kernels cuda-graphs tp mesh vllm)
mkdir -p "$OUT" "$WORK/logs"
: > "$OUT/summary.txt"
export PYTHONUNBUFFERED=1
# The C++ CPU kernels are not what runs on a GPU: never spend minutes building them.
export LLM_MESH_CPU_KERNELS=0

if [ $DRY_RUN = 1 ]; then
  export KERNEL_TEST_DEVICE=cpu
  SHAPES=(tiny)
  DEVICE_ARGS="--device cpu --dtype float32 --num-threads 1 --max-model-len 512"
  SWEEP="--concurrency 1,4 --input-len 32 --output-len 16"
  VLLM_ARGS="--device cpu --dtype float32"
else
  export KERNEL_TEST_DEVICE=cuda
  SHAPES=(smollm2-135m llama3-8b)
  DEVICE_ARGS="--device cuda --dtype bfloat16 --max-num-seqs 256 \
--max-num-batched-tokens 8192 --max-model-len 4096"
  SWEEP="--concurrency 1,8,32,128 --input-len 256 --output-len 128"
  VLLM_ARGS="--dtype bfloat16 --max-num-seqs 256 --max-model-len 4096 \
--gpu-memory-utilization 0.85"
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi

record() {   # record NAME VERDICT FIGURES: one summary line
  printf '%-22s %-30s %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"
}

run_stage() {   # run_stage NAME TIMEOUT_S COMMAND...: PASS / FAIL by exit status
  local name=$1 limit=$2 started=$SECONDS rc verdict command
  shift 2
  command="$*"
  echo "== $name: ${command:0:300}"
  timeout "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.log"
  rc=${PIPESTATUS[0]}
  verdict=PASS
  [ "$rc" = 0 ] || verdict="FAIL (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
  LAST_VERDICT=$verdict
  LAST_SECONDS=$((SECONDS - started))
}

pytest_stage() {   # pytest_stage NAME TIMEOUT_S PYTEST_ARGS...: SKIP when all skipped
  local name=$1 limit=$2 counts
  shift 2
  run_stage "$name" "$limit" "$PY" -m pytest -q -p no:cacheprovider --noconftest -rfEs \
    --tb=short "$@"
  counts=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$WORK/logs/$name.log" | tail -n 1)
  if [ "$LAST_VERDICT" = PASS ] && ! grep -q passed <<<"$counts"; then
    LAST_VERDICT="SKIP ($(grep -m1 -o 'SKIPPED.*' "$WORK/logs/$name.log" | cut -c1-80))"
  fi
  record "$name" "$LAST_VERDICT" "${counts:-no pytest summary} [${LAST_SECONDS} s]"
}

stage_device() {
  run_stage device 120 "$PY" -c "
import importlib, torch, triton, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
assert gpu or $DRY_RUN, 'no CUDA device'
print('device:', gpu or 'CPU (dry run)', torch.cuda.device_count() if gpu else '',
      '| torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__)
for m in ('services.gateway.__main__', 'services.tokenizer.__main__', 'xgrammar',
          'services.scheduler.__main__', 'services.worker.__main__', 'kernels.triton_fused_moe',
          'services.kvstore.__main__', 'services.batch.__main__', 'llm_mesh.launcher',
          'llm_mesh.bench.cli', 'benchmarks.serve_sweep'):
    importlib.import_module(m)
print('every service imports')"
  record device "$LAST_VERDICT" "$(grep -m1 '^device:' "$WORK/logs/device.log" \
    || tail -n 1 "$WORK/logs/device.log")"
}

stage_kernels() {
  pytest_stage kernels 480 --timeout 300 tests/kernels tests/worker/test_attention_backends.py
}

stage_cuda_graphs() {
  pytest_stage cuda-graphs 300 --timeout 240 tests/worker/test_cuda_graphs.py
}

stage_tp() {
  local gpus
  gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if [ $DRY_RUN = 0 ] && [ "$gpus" -lt 2 ]; then
    record tp "SKIP ($gpus GPU)" "NCCL ranks need a GPU each"
    return
  fi
  pytest_stage tp 420 --timeout 300 tests/worker/test_tp_commands.py \
    tests/kernels/test_launch_device.py tests/worker/test_tensor_parallel.py \
    -k "two_ranks_match_hf or rebuilds_every_call or launch or second_gpu"
  if [ $DRY_RUN = 0 ]; then
    checkpoint smollm2-135m
    run_stage tp-bench 300 "$PY" -m benchmarks.runner --model "$WORK/models/smollm2-135m" \
      --dtypes bfloat16 --batch-sizes 1,8,32,128 --kv-cache-gib 8 \
      --tensor-parallel-sizes 1,2 --kernels torch
    record tp-bench "$LAST_VERDICT" "$(grep -m1 -i 'ratio' "$WORK/logs/tp-bench.log")"
  fi
}

checkpoint() {   # checkpoint SHAPE: builds $WORK/models/SHAPE once
  [ -f "$WORK/models/$1/config.json" ] && return 0
  local device=cuda
  [ $DRY_RUN = 0 ] || device=cpu
  "$PY" -m benchmarks.random_checkpoint --shape "$1" --tokenizer .gpu/tokenizer \
    --out "$WORK/models/$1" --device $device --dtype bfloat16 2>&1 | tail -n 1
}

sweep_stage() {   # sweep_stage SERVER SHAPE SERVER_ARGS
  local name="$1-$2"
  if ! checkpoint "$2" > "$WORK/logs/$name.checkpoint.log" 2>&1; then
    record "$name" FAIL "no checkpoint: $(tail -n 1 "$WORK/logs/$name.checkpoint.log")"
    return
  fi
  # shellcheck disable=SC2086  # SWEEP holds several flags
  run_stage "$name" 540 "$PY" -m benchmarks.serve_sweep --server "$1" \
    --model "$WORK/models/$2" --server-args "$3" $SWEEP --out "$WORK/sweep"
  record "$name" "$LAST_VERDICT" "[${LAST_SECONDS} s]"
  grep -E "^$1 $2 c=" "$WORK/logs/$name.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
}

stage_mesh() {
  for shape in "${SHAPES[@]}"; do
    sweep_stage mesh "$shape" "$DEVICE_ARGS"
  done
}

stage_vllm() {
  local found
  found=$("$PY" -m pip list 2>/dev/null | grep -i vllm)
  if [ -z "$found" ]; then
    record vllm "SKIP (not in this image)" "pip list | grep -i vllm: nothing"
    return
  fi
  record vllm found "$(echo "$found" | tr -s ' ' | tr '\n' ' ')"
  for shape in "${SHAPES[@]}"; do
    sweep_stage vllm "$shape" "$VLLM_ARGS"
  done
}

stage_runner() {
  checkpoint smollm2-135m
  run_stage runner 420 "$PY" -m benchmarks.runner --model "$WORK/models/smollm2-135m" \
    --dtypes bfloat16,float32 --batch-sizes 1,8,32,64,128,256 --kv-cache-gib 8 \
    --prompt-len 128 --kernels torch --profile-batch 32 --profile-rows 25
  record runner "$LAST_VERDICT" "[${LAST_SECONDS} s]"
}

for stage in "${STAGES[@]}"; do
  case $stage in
    device|kernels|cuda-graphs|tp|mesh|vllm|runner) "stage_${stage//-/_}" ;;
    *) record "$stage" "FAIL (unknown stage)" "choose from device kernels cuda-graphs tp mesh vllm runner" ;;
  esac
done

tar czf "$OUT/logs.tar.gz" -C "$WORK" logs $( [ -d "$WORK/sweep" ] && echo sweep )
echo
echo "== summary ($([ $DRY_RUN = 1 ] && echo 'CPU dry run' || echo GPU), $(date -u +%FT%TZ))"
cat "$OUT/summary.txt"
! grep -q '^[^ ]* *FAIL' "$OUT/summary.txt"
