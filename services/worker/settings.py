"""The worker's settings (flags keep vLLM's names where the concept is the same)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import CommonSettings, EngineSettings, setting


@dataclass
class WorkerSettings(CommonSettings, EngineSettings):
    dtype: str = setting("float32", "Weights and activations dtype",
                         choices=("float32", "bfloat16", "float16"))
    kv_cache_dtype: str = setting("auto", "KV cache dtype (fp8: e4m3 with scales, half the "
                                  "bytes)", choices=("auto", "fp8"))
    kv_cache_memory: int = setting(0, "Bytes of KV cache (0: --kv-cache-memory-fraction of "
                                   "available RAM on CPU)")
    kv_cache_memory_fraction: float = setting(0.25, "CPU: share of available RAM for the KV "
                                              "cache when --kv-cache-memory is 0")
    gpu_memory_utilization: float = setting(0.9, "Accelerator: share of its memory this "
                                            "worker may use (weights, activations, KV)")
    device: str = setting("auto", "Where the model runs", choices=("auto", "cpu", "cuda"))
    attention_backend: str = setting("auto", "Attention implementation (auto: triton on "
                                     "cuda, torch on cpu)", choices=("auto", "torch", "triton"))
    num_threads: int = setting(0, "CPU threads for the model (0: all cores)")
