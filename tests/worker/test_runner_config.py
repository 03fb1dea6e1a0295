"""The model runner's configuration comes from the worker's settings: one source per knob,
the same defaults, a flag's 0 ("unset") as None."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from services.common.speculative_config import parse_speculative_config
from services.worker.runner.config import RunnerConfig
from services.worker.settings import WorkerSettings

# Runner fields no flag sets: where the model is (the service resolves --model), and CUDA
# graphs (on wherever they can run).
NOT_SETTINGS = {"model_dir", "enable_cuda_graphs"}


def test_every_runner_field_is_a_worker_setting_with_the_same_default() -> None:
    runner_fields = {f.name for f in dataclasses.fields(RunnerConfig)} - NOT_SETTINGS
    assert runner_fields <= {f.name for f in dataclasses.fields(WorkerSettings)}
    from_settings = RunnerConfig.from_settings(WorkerSettings(), Path("/m"))
    assert from_settings == RunnerConfig(model_dir=Path("/m"))


def test_settings_reach_the_runner_unset_as_none() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    settings = WorkerSettings(max_num_batched_tokens=256, max_model_len=0, num_threads=2,
                              max_cpu_loras=0, kv_cache_memory=1 << 20, enable_lora=True,
                              speculative_config=spec)
    config = RunnerConfig.from_settings(settings, Path("/m"))
    assert (config.max_num_batched_tokens, config.max_model_len, config.num_threads,
            config.max_cpu_loras, config.kv_cache_memory, config.enable_lora) == (
        256, None, 2, None, 1 << 20, True)
    assert config.speculative_config == parse_speculative_config(spec)
