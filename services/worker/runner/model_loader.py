"""Building the model a worker rank runs: its attention backend, weights (this rank's shard
under tensor parallelism) and KV cache shape. Shared by the model runner (rank 0) and the
tensor-parallel followers (parallel/ranks.py), so every rank builds its part the same way."""

from __future__ import annotations

import time

import structlog
import torch

from services.worker.attention import get_attention_backend_cls
from services.worker.attention.backend import AttentionBackend
from services.worker.kv.kv_cache import KVCacheSpec, kv_cache_dtype
from services.worker.models.checkpoint_quant import read_checkpoint_quant
from services.worker.models.config import ModelConfig
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.quantized import BlockSource
from services.worker.models.registry import CausalLM, model_class
from services.worker.models.smoothing import SmoothedWeights
from services.worker.models.weights import WeightSource
from services.worker.runner.batch_invariance import enable_batch_invariance
from services.worker.runner.config import RunnerConfig

log = structlog.get_logger(__name__)


def attention_backend(config: RunnerConfig, model_config: ModelConfig,
                      device: torch.device) -> AttentionBackend:
    return get_attention_backend_cls(config.attention_backend, device, config.kv_cache_dtype)(
        model_config.num_attention_heads, model_config.num_key_value_heads,
        model_config.head_dim, model_config.head_dim ** -0.5, config.block_size)


def kv_cache_spec(config: RunnerConfig, model_config: ModelConfig) -> KVCacheSpec:
    # NOTE: a hybrid's Mamba layers keep no KV: their state lives in per-row slots
    # (hybrid_states.py).
    return KVCacheSpec(model_config.num_attention_layers, model_config.num_key_value_heads,
                       model_config.head_dim, config.block_size,
                       kv_cache_dtype(config.kv_cache_dtype, config.torch_dtype))


def uses_int8_smoothing(config: RunnerConfig, model_config: ModelConfig) -> bool:
    """--quantization int8 folds SmoothQuant's scales into the weights (models/smoothing.py)
    where that is exact: the Llama family's layout (no MoE, no vision tower), no LoRA (an
    adapter's A would read the smoothed input), one rank (the other ranks read their own
    weights), not a checkpoint stored quantized (its own scales rule)."""
    return (config.quantization == "int8"
            and model_class(model_config.model_type) is LlamaForCausalLM
            and model_config.vision_model_type is None and not config.enable_lora
            and config.tensor_parallel_size == 1
            and read_checkpoint_quant(config.model_dir) is None)


def weight_source(config: RunnerConfig, model_config: ModelConfig,
                  device: torch.device) -> WeightSource:
    if not uses_int8_smoothing(config, model_config):
        return WeightSource(config.model_dir, config.torch_dtype, device)
    started = time.perf_counter()
    weights = SmoothedWeights(config.model_dir, config.torch_dtype, device,
                              model_config.num_hidden_layers)
    log.info("int8: SmoothQuant scales calibrated and folded into the weights",
             seconds=round(time.perf_counter() - started, 2))
    return weights


def load_model(config: RunnerConfig, model_config: ModelConfig, weights: WeightSource,
               attn: AttentionBackend, max_model_len: int,
               use_gguf_blocks: bool = True) -> CausalLM:
    started = time.perf_counter()
    blocks = _gguf_blocks(config, weights.device) if use_gguf_blocks else None
    model = model_class(model_config.model_type)(model_config, weights, attn, max_model_len,
                                                 blocks, config.quantization)
    if config.batch_invariant:
        enable_batch_invariance(model, attn)
    log.info("model weights loaded", model=config.model_dir.name,
             model_type=model_config.model_type, dtype=config.dtype, device=str(weights.device),
             attention_backend=attn.name, seconds=round(time.perf_counter() - started, 2),
             weight_bytes=model.num_bytes, small_batch_weight_bytes=model.small_batch_bytes,
             threads=torch.get_num_threads())
    return model


def _gguf_blocks(config: RunnerConfig, device: torch.device) -> BlockSource | None:
    """The GGUF blocks saved with a converted model, where fp32 or bf16 batches on the CPU
    can read them (Linear decides per matrix)."""
    if (not config.use_gguf_blocks or device.type != "cpu"
            or config.torch_dtype not in (torch.float32, torch.bfloat16)):
        return None
    return BlockSource.of_model_dir(config.model_dir)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown --device {device!r} (choose from auto, cpu, cuda)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    return torch.device(device)


def max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    limit = model_config.max_context
    if requested is not None and requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's "
                         f"context ({limit}: max_position_embeddings, rope scaling included)")
    # NOTE: sliding-window layers attend within their window (attention/), so a window does
    # not bound the context; their KV outside the window is kept, not freed.
    return requested or limit
