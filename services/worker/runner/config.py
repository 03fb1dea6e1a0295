"""What the worker service passes to the model runner, and what the runner reports back.

RunnerConfig is built from the worker's settings (RunnerConfig.from_settings): a field takes
the setting of the same name, so each knob has one source, and the defaults here are the
settings' (tests/common/test_settings_sources.py keeps them equal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.speculative_config import SpeculativeConfig
from services.worker.models.int8 import check_quantization
from services.worker.settings import WorkerSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Settings whose 0 means "unset" (a flag has no None); the runner takes None.
_UNSET_WHEN_ZERO = ("max_model_len", "kv_cache_memory", "num_threads", "max_cpu_loras",
                    "num_state_checkpoints")


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: Path                        # HF-style dir: config.json, *.safetensors, tokenizer
    use_gguf_blocks: bool = True           # fp32 on CPU, a converted GGUF model: steps of a
                                           # few rows read its blocks (models/quantized.py)
    dtype: str = "float32"                 # float32 | bfloat16 | float16
    quantization: str = "none"             # none | int8 (CPU: W8A8 linears, models/int8.py)
    kv_cache_dtype: str = "auto"           # auto (= dtype) | fp8 (e4m3: half the KV bytes)
    block_size: int = 16
    max_model_len: int | None = None       # None: the model's max_position_embeddings
    kv_cache_memory: int | None = None     # bytes for KV; None: a fraction of RAM (CPU)
    kv_cache_memory_fraction: float = 0.25
    gpu_memory_utilization: float = 0.9    # accelerator: share of device memory we may use
    device: str = "auto"                   # auto | cpu | cuda
    attention_backend: str = "auto"        # auto (cuda: triton, cpu: torch) | torch | triton
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 128
    seed: int = 0
    num_threads: int | None = None         # CPU threads; None: all cores
    enable_cuda_graphs: bool = True        # cuda + triton only: decode steps replay graphs
    grammar_cache_size: int = 64           # structured outputs: compiled grammars kept (LRU)
    speculative_config: SpeculativeConfig | None = None   # None: no speculative decoding
    tensor_parallel_size: int = 1          # ranks the model is split over (parallel/)
    enable_lora: bool = False              # serve LoRA adapters (lora/)
    max_loras: int = 1                     # adapters one step may mix (slots in the model)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None       # adapters kept in host memory; None: max_loras
    encoder_cache_size: int = 8192         # vision models: image embedding rows kept (LRU)
    batch_invariant: bool = False          # fixed reduction orders (runner/batch_invariance.py)
    num_state_checkpoints: int | None = None   # hybrid models: state copies for prefix
                                               # caching (hybrid_states.py); None: max_num_seqs

    @classmethod
    def from_settings(cls, settings: WorkerSettings, model_dir: Path) -> RunnerConfig:
        """The runner's configuration: every field from the setting of its name (a flag's 0,
        "unset", as None), the speculative config parsed."""
        names = ({f.name for f in dataclasses.fields(cls)}
                 & {f.name for f in dataclasses.fields(settings)}) - {"speculative_config"}
        values = {name: getattr(settings, name) for name in names}
        for name in _UNSET_WHEN_ZERO:
            values[name] = values[name] or None
        return cls(model_dir=model_dir, speculative_config=settings.speculative, **values)

    def __post_init__(self) -> None:
        check_quantization(self.quantization, self.device)
        if self.batch_invariant and (self.tensor_parallel_size > 1 or self.enable_lora):
            raise ValueError("--batch-invariant covers one rank without LoRA adapters")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got "
                             f"{self.tensor_parallel_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown --dtype {self.dtype!r} (choose from "
                             f"{', '.join(DTYPES)})") from None


@dataclass(frozen=True)
class RunnerInfo:
    num_blocks: int            # including the null block 0
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_name: str
