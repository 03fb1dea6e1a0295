"""Tiny models run with TritonLayerOps (the CUDA path's layer ops) against HF transformers.

Runnable as `python -m tests.kernels.layer_ops_model_cases` on KERNEL_TEST_DEVICE (see
harness.json_cases): compiled on CUDA, where the model picks TritonLayerOps itself, and under
TRITON_INTERPRET=1 on CPU, where it would pick the C++ or torch layer ops, so the choice is
patched to TritonLayerOps; prints one JSON line per model, with the error if any.
Llama rotates q and k in place through their view of the qkv output; Qwen3 normalizes strided
head views first.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from services.worker.models import llama
from services.worker.models.layer_ops import TorchLayerOps, TritonLayerOps
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.kernels.harness import DEVICE
from tests.worker.tiny_models import assert_logprobs_match_hf, save_tiny_model

MODELS = ("llama", "qwen3")


def _check_model(name: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        hf = save_tiny_model(name, Path(directory))
        runner = ModelRunner(RunnerConfig(model_dir=Path(directory), kv_cache_memory=2**20,
                                          max_num_seqs=4, device=DEVICE))
        assert isinstance(runner.model.ops, TritonLayerOps)
        assert_logprobs_match_hf(hf, runner)


def _triton_layer_ops(device: torch.device, cpu_kernels: object) -> TorchLayerOps:
    del device, cpu_kernels
    return TritonLayerOps()


def main() -> None:
    llama.layer_ops_for = _triton_layer_ops
    for name in MODELS:
        try:
            # NOTE: the runner logs to stdout, which carries this module's JSON lines.
            with contextlib.redirect_stdout(sys.stderr):
                _check_model(name)
            error = None
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            error = traceback.format_exc()
        print(json.dumps({"case": name, "error": error}), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
