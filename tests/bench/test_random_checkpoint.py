"""benchmarks/random_checkpoint.py, which the GPU check builds its served models with: the
SmolLM2 shape is the embedded model's, and a built checkpoint carries the embedded tokenizer
(vocabulary and special ids in its config, the files beside it) and decodes in the worker."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.random_checkpoint import SHAPES, TOKENIZER_FILES, build
from services.common.model_files import resolve_model
from services.worker.models.config import ModelConfig
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver


def test_the_smollm2_shape_is_the_embedded_models() -> None:
    real = json.loads((resolve_model("").hf_dir / "config.json").read_text())
    for key, value in SHAPES["smollm2-135m"].items():
        if key != "rms_norm_eps":   # the GGUF's is 1e-5 as float32
            assert real[key] == value, key


def test_a_built_checkpoint_has_the_tokenizer_and_decodes(tmp_path: Path) -> None:
    tokenizer_dir = resolve_model("").hf_dir
    params = build("tiny", tokenizer_dir, tmp_path, "cpu", torch.float32)
    saved = load_file(tmp_path / "model.safetensors")
    assert params == sum(t.numel() for t in saved.values()) > 0
    config = ModelConfig.from_hf_dir(tmp_path)
    assert config.vocab_size == 49152 and 2 in config.eos_token_ids
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name
    runner = ModelRunner(RunnerConfig(model_dir=tmp_path, kv_cache_memory=1 << 20,
                                      max_model_len=256, max_num_seqs=2))
    try:
        driver = StepDriver(runner)
        handle = driver.add([1, 504, 3145, 30, 2], max_new_tokens=4, stop_at_eos=False)
        output = driver.run()[handle]
    finally:
        runner.close()
    assert len(output) == 4 and all(0 <= t < 49152 for t in output)
