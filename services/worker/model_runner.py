"""The model runner: loads the model and its KV cache, then executes one step per StepInput.

NOTE (size guard): this is the worker's hot file. It only orchestrates a step — apply the diffs,
prepare the batch, forward, sample, pack the output — and each of those lives in its own module
(input_batch, step_batch, attention/, models/, sampler, step_output, cuda_graphs). Keep it under
~300 lines: a new feature gets its own module, not a branch here (vLLM's gpu_model_runner.py
reached 7,000 lines by absorbing features one branch at a time).
"""

from __future__ import annotations

import math
import time

import numpy as np
import structlog
import torch

from services.common import wire
from services.common.metrics import GrammarMetrics
from services.common.packing import unpack_int32
from services.common.startup import StartupPhases
from services.worker.attention import get_attention_backend_cls
from services.worker.config import RunnerConfig, RunnerInfo
from services.worker.cpu_runtime import configure_cpu_runtime
from services.worker.cuda_graphs import CudaGraphRunner
from services.worker.input_batch import InputBatch
from services.worker.kv.connector import WorkerKVConnector, kv_fingerprint
from services.worker.kv_cache import (
    KVCacheSpec,
    accelerator_kv_budget,
    allocate_kv_caches,
    available_cpu_memory,
    kv_cache_dtype,
    log_kv_cache_size,
    num_blocks_for_budget,
)
from services.worker.models.config import ModelConfig
from services.worker.models.quantized import BlockSource
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.weights import WeightSource
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import build_sampling_metadata
from services.worker.step_batch import StepBatch, dummy_step_batch, prepare_step_batch
from services.worker.step_output import build_step_output
from services.worker.structured_outputs import StructuredOutputs, load_tokenizer_info

log = structlog.get_logger(__name__)


class ModelRunner:
    def __init__(self, config: RunnerConfig, grammar_metrics: GrammarMetrics | None = None,
                 startup: StartupPhases | None = None):
        self.config = config
        startup = startup or StartupPhases()
        self.device = _resolve_device(config.device)
        with startup.phase("runtime and kernels"):
            if self.device.type == "cpu":
                configure_cpu_runtime(config.num_threads)
            torch.manual_seed(config.seed)
            self.model_config = model_config = ModelConfig.from_hf_dir(config.model_dir)
            self.max_model_len = _max_model_len(config.max_model_len, model_config)
            self.block_size = config.block_size
            self.attn_backend = get_attention_backend_cls(
                config.attention_backend, self.device, config.kv_cache_dtype)(
                model_config.num_attention_heads, model_config.num_key_value_heads,
                model_config.head_dim, model_config.head_dim ** -0.5, config.block_size)
        self.kv_spec = KVCacheSpec(
            model_config.num_hidden_layers, model_config.num_key_value_heads,
            model_config.head_dim, config.block_size,
            kv_cache_dtype(config.kv_cache_dtype, config.torch_dtype))
        memory_before_load = (torch.cuda.mem_get_info(self.device)
                              if self.device.type == "cuda" else None)
        with startup.phase("weights"):
            self.model = self._load_model()
        with startup.phase("KV cache"):
            num_blocks = self._num_kv_blocks(memory_before_load)
            self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
            self.model.bind_kv_caches(self.kv_caches)
        log_kv_cache_size(self.kv_spec, num_blocks, self.max_model_len)
        self.max_num_blocks_per_req = math.ceil(self.max_model_len / config.block_size)
        self.structured_outputs = StructuredOutputs(
            lambda: load_tokenizer_info(config.model_dir, model_config.vocab_size,
                                        list(model_config.eos_token_ids)),
            config.max_num_seqs, model_config.vocab_size, config.grammar_cache_size,
            grammar_metrics)
        self.input_batch = InputBatch(config.max_num_seqs, self.max_model_len,
                                      self.max_num_blocks_per_req, model_config.eos_token_ids,
                                      self.device, self.structured_outputs)
        self.sampler = Sampler(self.device, config.seed)
        self.cuda_graphs: CudaGraphRunner | None = None
        if (self.device.type == "cuda" and config.enable_cuda_graphs
                and self.attn_backend.name == "triton"):
            self.cuda_graphs = CudaGraphRunner(self.model, self.attn_backend, config.max_num_seqs,
                                               self.max_num_blocks_per_req, self.device)
            with startup.phase("CUDA graphs"):
                self.cuda_graphs.capture()
        self.info = RunnerInfo(num_blocks=num_blocks, block_size=config.block_size,
                               max_model_len=self.max_model_len,
                               vocab_size=model_config.vocab_size,
                               eos_token_ids=list(model_config.eos_token_ids),
                               model_name=config.model_dir.name)
        self.kv_fingerprint = kv_fingerprint(config.model_dir, self.kv_spec, config.quantization)
        self.kv_connector: WorkerKVConnector | None = None
        """Moves blocks to / from the kvstore between forward passes; set by the service."""

    def execute(self, step: wire.StepInput) -> wire.StepOutput:
        """Runs one step. Never raises: a failure comes back as StepOutput.error."""
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self._execute(step)
        except Exception as e:  # noqa: BLE001 - the worker must outlive a bad step
            log.exception("step failed", step=step.step)
            out = wire.StepOutput(step=step.step, error=f"{type(e).__name__}: {e}")
        out.execute_s = time.perf_counter() - started
        return out

    def _execute(self, step: wire.StepInput) -> wire.StepOutput:
        self._update_states(step)
        connector = self.kv_connector
        if connector is not None:
            connector.before_forward(step)
        batch = prepare_step_batch(step, self.input_batch, self.block_size, self.device)
        if batch is None:
            out = wire.StepOutput(step=step.step)
            if connector is not None:
                connector.finish_step(out, is_idle=True)
            return out
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        num_samples = len(batch.sampling_index)
        sample_rows = batch.rows[batch.sampling_index]
        metadata = build_sampling_metadata(self.input_batch, sample_rows,
                                           self.model_config.vocab_size, self.device)
        sampler_output = self.sampler(logits[:num_samples], metadata)
        sampled = sampler_output.sampled_token_ids.cpu().numpy().astype(np.int32)
        self.input_batch.num_computed_tokens[batch.rows] = batch.seq_lens
        self.input_batch.append_sampled(sample_rows, sampled, metadata.deferred_rows)
        out = build_step_output(step.step, batch, sampled, sampler_output,
                                metadata.logprob_rows, logits[num_samples:],
                                metadata.unreported_rows, metadata.rejections,
                                metadata.deferred_rows)
        if connector is not None:
            connector.after_forward(step)
            connector.finish_step(out, is_idle=False)
        return out

    def _update_states(self, step: wire.StepInput) -> None:
        """Applies the step's diffs in the wire's order: finished, new, then cached requests."""
        if step.reset:
            self.input_batch.reset()
        for handle in unpack_int32(step.finished_handles).tolist():
            self.input_batch.remove_request(handle)
        for new in step.new_requests:
            self.input_batch.add_request(new)
        if step.cached_handles:
            self.input_batch.update_cached(
                unpack_int32(step.cached_handles), unpack_int32(step.cached_num_new_blocks),
                unpack_int32(step.cached_new_block_ids),
                unpack_int32(step.cached_num_computed_tokens))

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        attn_metadata = self.attn_backend.build_metadata(batch.attn)
        return self.model.forward(batch.input_ids, batch.positions, attn_metadata)

    def _load_model(self) -> LlamaForCausalLM:
        started = time.perf_counter()
        weights = WeightSource(self.config.model_dir, self.config.torch_dtype, self.device)
        model = LlamaForCausalLM(self.model_config, weights, self.attn_backend,
                                 self.max_model_len, self._gguf_blocks(), self.config.quantization)
        log.info("model weights loaded", model=self.config.model_dir.name,
                 model_type=self.model_config.model_type, dtype=self.config.dtype,
                 device=str(self.device), attention_backend=self.attn_backend.name,
                 seconds=round(time.perf_counter() - started, 2), weight_bytes=model.num_bytes,
                 small_batch_weight_bytes=model.small_batch_bytes,
                 threads=torch.get_num_threads())
        return model

    def _gguf_blocks(self) -> BlockSource | None:
        """The GGUF blocks saved with a converted model, where small fp32 batches on the CPU
        can read them."""
        config = self.config
        if (not config.use_gguf_blocks or self.device.type != "cpu"
                or config.torch_dtype != torch.float32):
            return None
        return BlockSource.of_model_dir(config.model_dir)

    def _num_kv_blocks(self, memory_before_load: tuple[int, int] | None) -> int:
        """CPU: --kv-cache-memory, or a fraction of available RAM. Accelerator: vLLM's rule,
        utilization x total minus others' use, our weights and peak activations."""
        config = self.config
        if memory_before_load is not None:
            free, total = memory_before_load
            budget = accelerator_kv_budget(config.gpu_memory_utilization, total, total - free,
                                           self._profile_peak_bytes())
        else:
            budget = config.kv_cache_memory or int(
                config.kv_cache_memory_fraction * available_cpu_memory())
        is_default_budget = memory_before_load is None and config.kv_cache_memory is None
        return num_blocks_for_budget(self.kv_spec, budget, self.max_model_len,
                                     config.max_num_seqs, is_default_budget)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak device memory of a forward pass at max_num_batched_tokens (weights included),
        run against a throwaway KV cache just big enough for it."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_samples = min(self.config.max_num_seqs, num_tokens)
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = allocate_kv_caches(self.kv_spec, math.ceil(num_tokens / self.block_size) + 1,
                                    self.device)
        self.model.bind_kv_caches(caches)
        batch = dummy_step_batch(num_tokens, self.block_size, self.device)
        hidden = self.model.forward(batch.input_ids, batch.positions,
                                    self.attn_backend.build_metadata(batch.attn))
        logits = self.model.compute_logits(hidden[:num_samples])
        logits.log_softmax(dim=-1).sort(dim=-1)  # the sampler's largest temporaries
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden, logits
        torch.cuda.empty_cache()
        log.info("profiled a forward pass", num_tokens=num_tokens, peak_bytes=peak)
        return peak


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown --device {device!r} (choose from auto, cpu, cuda)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible")
    return torch.device(device)


def _max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if requested is not None and requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    max_model_len = requested or limit
    window = model_config.sliding_window
    if window is not None and max_model_len > window:
        # NOTE: within the window, sliding-window attention is plain causal attention; we
        # implement only that, so contexts stop at the window.
        log.warning("capping max_model_len at the model's sliding window", sliding_window=window)
        max_model_len = window
    return max_model_len
