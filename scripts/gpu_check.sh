#!/usr/bin/env bash
# The GPU check (issue 4), one prepared script for a lent accelerator, ~8 minutes:
#   1. the Triton kernel tests on CUDA, compiled rather than interpreted, with the shapes
#      too big for the interpreter (tests/kernels: cache write, paged decode with and without
#      KV splits, varlen prefill over a paged context, fp8);
#   2. the worker's decode step time and prefill speed with the triton backend and CUDA
#      graphs (benchmarks/runner.py), bf16 and fp32, batch 1..256, on a random model of
#      SmolLM2-135M's shape (the embedded model's wheel is too big to travel to the device),
#      and the torch profiler's kernel table for 32 requests' decode steps;
#   3. tensor parallelism over NCCL, where there are two GPUs (a rank needs one of its own):
#      two ranks against HF on tiny models of each dense family, and the TP=2 / TP=1 step
#      time on the SmolLM2-shaped model.
# Results land in $OUT (default bench-results/gpu); summary.txt says which stage failed.
# Every stage runs whatever the one before it did.
#
# The device image has python3 with torch, triton, transformers and pytest; the project's
# dependencies it lacks travel as wheels in .whl/ (the versions .venv holds), made with:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       betterproto==2.0.0b7 grpclib structlog nats-py gguf h2 hpack hyperframe \
#       httpx2 httpcore2 truststore sniffio pydantic pydantic_core annotated-types \
#       typing-inspection xgrammar apache-tvm-ffi
# They install into /tmp/site, leaving the image's own environment as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The C++ CPU kernels are not what runs on a GPU: never spend minutes building them here.
export LLM_MESH_CPU_KERNELS=0

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

stage() {   # stage NAME LOG COMMAND...: runs it, keeps its output, records its exit status
  local name=$1 log=$2
  shift 2
  echo "== $name" | tee -a "$OUT/summary.txt"
  "$@" 2>&1 | tee "$OUT/$log"
  echo "   $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
}

stage device device.txt $PY -c "import torch, triton, transformers; \
assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

# --noconftest: the mesh fixtures (NATS, services) are not needed here. The window-backend
# cases of the C++ CPU kernels and of the interpreter belong to the CPU suite.
export KERNEL_TEST_DEVICE=cuda
stage kernel-tests kernel-tests.txt timeout 240 $PY -m pytest -q -p no:cacheprovider \
  --noconftest --timeout 120 -rfE --tb=short tests/kernels \
  -k "not cpu_kernel_backend and not in_interpreter"

MODEL_DIR=/tmp/smollm2-shaped-random
cat > /tmp/make_random_model.py <<'EOF'
import sys

import torch
import transformers

config = transformers.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2)
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(sys.argv[1])
EOF
stage random-model model.txt $PY /tmp/make_random_model.py "$MODEL_DIR"

stage bench-runner bench-runner.txt timeout 240 $PY -m benchmarks.runner --model "$MODEL_DIR" \
  --dtypes bfloat16,float32 --batch-sizes 1,8,32,64,128,256 --kv-cache-gib 8 \
  --prompt-len 128 --kernels torch --profile-batch 32 --profile-rows 25

NUM_GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NUM_GPUS" -ge 2 ]; then
  stage tp-tests tp-tests.txt timeout 240 $PY -m pytest -q -p no:cacheprovider --noconftest \
    tests/worker/test_tensor_parallel.py -k two_ranks_match_hf
  stage bench-tp bench-tp.txt timeout 240 $PY -m benchmarks.runner --model "$MODEL_DIR" \
    --dtypes bfloat16 --batch-sizes 1,8,32,128 --kv-cache-gib 8 --tensor-parallel-sizes 1,2 \
    --kernels torch
else
  echo "tensor parallel: skipped, $NUM_GPUS GPU (NCCL ranks need a GPU each)" \
    | tee -a "$OUT/summary.txt"
fi
