#!/usr/bin/env bash
# The GPU check (issue 4), one prepared script for a lent accelerator, ~8 minutes:
#   1. the Triton kernel tests on CUDA, compiled rather than interpreted, with the shapes
#      too big for the interpreter (tests/kernels: cache write, paged decode with and without
#      KV splits, varlen prefill over a paged context, fp8);
#   2. the worker's decode step time and prefill speed with the triton backend and CUDA
#      graphs (benchmarks/runner.py), bf16 and fp32, batch 1..256, on a random model of
#      SmolLM2-135M's shape (the embedded model's wheel is too big to travel to the device);
#   3. tensor parallelism over NCCL, where there are two GPUs (a rank needs one of its own):
#      two ranks against HF on tiny models of each dense family, and the TP=2 / TP=1 step
#      time on the SmolLM2-shaped model.
# Results land in $OUT (default bench-results/gpu).
#
# The device image has python3 with torch, triton, transformers and pytest; the project's
# pure-Python dependencies it lacks travel as wheels in .whl/, made here with:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       betterproto==2.0.0b7 grpclib structlog nats-py gguf h2 hpack hyperframe \
#       multidict python-dateutil
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-deps --no-index .whl/*.whl
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__)" | tee "$OUT/device.txt"

# --noconftest: the mesh fixtures (NATS, services) are not needed and not installed there.
KERNEL_TEST_DEVICE=cuda timeout 240 $PY -m pytest -q -p no:cacheprovider --noconftest \
  tests/kernels 2>&1 | tee "$OUT/kernel-tests.txt"

MODEL_DIR="$OUT/smollm2-shaped-random"
$PY - "$MODEL_DIR" <<'EOF'
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

timeout 300 $PY -m benchmarks.runner --model "$MODEL_DIR" --dtypes bfloat16,float32 \
  --batch-sizes 1,8,32,64,128,256 --kv-cache-gib 8 --prompt-len 128 \
  2>&1 | tee "$OUT/bench-runner.txt"

NUM_GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NUM_GPUS" -ge 2 ]; then
  timeout 240 $PY -m pytest -q -p no:cacheprovider --noconftest \
    tests/worker/test_tensor_parallel.py -k two_ranks_match_hf 2>&1 | tee "$OUT/tp-tests.txt"
  timeout 240 $PY -m benchmarks.runner --model "$MODEL_DIR" --dtypes bfloat16 \
    --batch-sizes 1,8,32,128 --kv-cache-gib 8 --tensor-parallel-sizes 1,2 \
    2>&1 | tee "$OUT/bench-tp.txt"
else
  echo "tensor parallel: skipped, $NUM_GPUS GPU (NCCL ranks need a GPU each)" \
    | tee "$OUT/tp-tests.txt"
fi
