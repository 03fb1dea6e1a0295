"""The model runner: loads the model and its KV cache, then executes one step per StepInput.

NOTE (size guard): this is the worker's hot file. It only orchestrates a step — apply the diffs,
prepare the batch, forward, sample, pack the output — and each of those lives in its own module
(input_batch, step_batch, attention/, models/, sampling/, step_output, cuda_graphs). Keep it
under ~300 lines: a new feature gets its own module and joins the step through its hooks
(step_hooks.py), not a branch here (vLLM's gpu_model_runner.py reached 7,000 lines by
absorbing features one branch at a time).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import structlog
import torch

from services.common import wire_pb
from services.common.metrics import EncoderCacheMetrics, GrammarMetrics
from services.common.packing import unpack_int32
from services.common.startup import StartupPhases
from services.worker.kv.connector import WorkerKVConnector, kv_fingerprint
from services.worker.kv.kv_cache import (
    accelerator_kv_budget,
    allocate_kv_caches,
    available_cpu_memory,
    explicit_accelerator_kv_budget,
    log_kv_cache_size,
    num_blocks_for_budget,
)
from services.worker.lora import RunnerLora, enable_lora
from services.worker.models.config import ModelConfig
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.registry import CausalLM
from services.worker.multimodal import RunnerMultiModal, enable_multimodal
from services.worker.parallel.ranks import TensorParallelModel, TensorParallelRanks, pin_rank_cores
from services.worker.runner.config import RunnerConfig, RunnerInfo
from services.worker.runner.cpu_runtime import configure_cpu_runtime
from services.worker.runner.cuda_graphs import CudaGraphRunner
from services.worker.runner.hybrid_states import check_hybrid_config, enable_hybrid_states
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.model_loader import (
    attention_backend,
    kv_cache_spec,
    load_model,
    max_model_len,
    resolve_device,
    uses_int8_smoothing,
    weight_source,
)
from services.worker.runner.step_batch import StepBatch, dummy_step_batch, prepare_step_batch
from services.worker.runner.step_hooks import StepHooks, TextInputs
from services.worker.runner.step_output import build_step_output
from services.worker.sampling.sampler import Sampler
from services.worker.sampling.sampling_metadata import build_sampling_metadata
from services.worker.sampling.structured_outputs import StructuredOutputs, load_tokenizer_info
from services.worker.spec_decode.draft_model_proposer import draft_kv_bytes_per_block
from services.worker.spec_decode.speculator import Speculator
from services.worker.spec_decode.verifier import DraftVerifier

log = structlog.get_logger(__name__)


class ModelRunner:
    def __init__(self, config: RunnerConfig, grammar_metrics: GrammarMetrics | None = None,
                 startup: StartupPhases | None = None,
                 encoder_cache_metrics: EncoderCacheMetrics | None = None):
        self.config = config
        startup = startup or StartupPhases()
        self.device = resolve_device(config.device)
        self.parallel: TensorParallelRanks | None = None
        with startup.phase("runtime and kernels"):
            self.model_config = model_config = ModelConfig.from_hf_dir(config.model_dir)
            self.max_model_len = max_model_len(config.max_model_len, model_config)
            check_hybrid_config(config, model_config)
            self.block_size = config.block_size
            if config.tensor_parallel_size > 1:   # before this rank keeps to its own cores
                self.parallel = TensorParallelRanks(config, model_config, self.device)
            if self.device.type == "cpu":
                configure_cpu_runtime(pin_rank_cores(config, 0) if self.parallel
                                      else config.num_threads)
            torch.manual_seed(config.seed)
        # What this rank builds: the whole model, or its shard's heads and MLP columns.
        rank_config = self.parallel.plan.rank_config if self.parallel else model_config
        self.attn_backend = attention_backend(config, rank_config, self.device)
        self.kv_spec = kv_cache_spec(config, rank_config)
        memory_before_load = (torch.cuda.mem_get_info(self.device)
                              if self.device.type == "cuda" else None)
        with startup.phase("weights"):
            self.model = self._load_model()
            self.multimodal: RunnerMultiModal | None = enable_multimodal(
                config, model_config, self.device, self.parallel is not None,
                encoder_cache_metrics)
            self.hybrid = enable_hybrid_states(lambda: self.model, config, model_config)
        with startup.phase("KV cache"):
            num_blocks = self._num_kv_blocks(memory_before_load)
            self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
            self.model.bind_kv_caches(self.kv_caches)
        log_kv_cache_size(self.kv_spec, num_blocks, self.max_model_len,
                          None if self.hybrid is None else self.hybrid.size)
        self.max_num_blocks_per_req = math.ceil(self.max_model_len / config.block_size)
        self.structured_outputs = StructuredOutputs(
            lambda: load_tokenizer_info(config.model_dir, model_config.vocab_size,
                                        list(model_config.eos_token_ids)),
            self._max_num_samples, model_config.vocab_size, config.grammar_cache_size,
            grammar_metrics)
        self.input_batch = InputBatch(config.max_num_seqs, self.max_model_len,
                                      self.max_num_blocks_per_req, model_config.eos_token_ids,
                                      self.device, self.structured_outputs)
        self.sampler = Sampler(self.device, config.seed)
        self.lora: RunnerLora | None = None
        if config.enable_lora:
            self.lora = RunnerLora(enable_lora(self.model, config.max_loras,
                                               config.max_lora_rank, config.max_cpu_loras))
        self.cuda_graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda":
            with startup.phase("CUDA graphs"):
                self._capture_cuda_graphs()
        self.info = RunnerInfo(num_blocks=num_blocks, block_size=config.block_size,
                               max_model_len=self.max_model_len,
                               vocab_size=model_config.vocab_size,
                               eos_token_ids=list(model_config.eos_token_ids),
                               model_name=config.model_dir.name)
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            with startup.phase("speculative decoding"):   # a draft model loads here
                self.speculator = Speculator(config, self.device, self.info, lambda: self.model)
        # NOTE: smoothed int8 computes other KV than plain int8 did before it.
        self.kv_fingerprint = kv_fingerprint(
            config.model_dir, self.kv_spec, config.quantization
            + ("+smoothquant" if uses_int8_smoothing(config, model_config) else ""))
        self.kv_connector: WorkerKVConnector | None = None
        """Moves blocks to / from the kvstore between forward passes (attach_kv_connector)."""
        # The optional features a step runs with, in hook order (step_hooks.py).
        self._hooks: list[StepHooks] = [feature for feature in (self.hybrid, self.lora,
                                                                self.multimodal, self.speculator)
                                        if feature is not None]
        self._inputs: TextInputs | RunnerMultiModal = self.multimodal or TextInputs()

    def attach_kv_connector(self, connector: WorkerKVConnector) -> None:
        """The worker service's KV connector joins every step from now on."""
        self.kv_connector = connector
        self._hooks.append(connector)

    def execute(self, step: wire_pb.StepInput) -> wire_pb.StepOutput:
        """Runs one step. Never raises: a failure comes back as StepOutput.error."""
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self._execute(step)
        except Exception as e:  # noqa: BLE001 - the worker must outlive a bad step
            log.exception("step failed", step=step.step)
            out = wire_pb.StepOutput(step=step.step, error=f"{type(e).__name__}: {e}")
        for hooks in self._hooks:
            hooks.report(out)
        out.execute_s = time.perf_counter() - started
        return out

    def _execute(self, step: wire_pb.StepInput) -> wire_pb.StepOutput:
        self._update_states(step)
        for hooks in self._hooks:
            hooks.before_forward(step)
        batch = prepare_step_batch(step, self.input_batch, self.block_size, self.device)
        if batch is None:
            out = wire_pb.StepOutput(step=step.step)
            for hooks in self._hooks:
                hooks.finish_step(step, out, ran_forward=False)
            return out
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sample_rows = batch.rows[batch.sampling_index]
        # One sampling row per position sampled at: 1 + the drafts a request verifies.
        position_rows = np.repeat(sample_rows, batch.num_sample_positions)
        num_samples = len(position_rows)
        metadata = build_sampling_metadata(self.input_batch, position_rows,
                                           self.model_config.vocab_size, self.device)
        verifier = (DraftVerifier(self.input_batch, sample_rows, batch.num_draft_tokens,
                                  metadata) if batch.num_draft_tokens.any() else None)
        sampler_output = self.sampler(logits[:num_samples], metadata)
        sampled = sampler_output.sampled_token_ids.cpu().numpy().astype(np.int32)
        self.input_batch.num_computed_tokens[batch.rows] = batch.seq_lens
        emitted = None
        if verifier is not None:
            num_accepted, emitted = verifier.verify(sampled)
            # Rejected drafts' KV is not the request's: it is overwritten from here on.
            self.input_batch.num_computed_tokens[sample_rows] -= (batch.num_draft_tokens
                                                                  - num_accepted)
        self.input_batch.append_sampled(position_rows, sampled, metadata.deferred_rows,
                                        emitted)
        handles = batch.handles[batch.sampling_index]
        out = build_step_output(step.step, batch,
                                np.repeat(handles, batch.num_sample_positions), sampled,
                                sampler_output, metadata.logprob_rows, logits[num_samples:],
                                metadata.unreported_rows, metadata.rejections,
                                metadata.deferred_rows, emitted)
        for hooks in self._hooks:
            hooks.after_sampling(self.input_batch, handles, sample_rows, out)
        for hooks in self._hooks:
            hooks.finish_step(step, out, ran_forward=True)
        return out

    def _update_states(self, step: wire_pb.StepInput) -> None:
        """Applies the step's diffs in the wire's order: finished, new, then cached requests."""
        if step.reset:
            self.input_batch.reset()
        finished = unpack_int32(step.finished_handles).tolist()
        for hooks in self._hooks:
            hooks.remove_requests(self.input_batch, finished)
        for handle in finished:
            self.input_batch.remove_request(handle)
        for new in step.new_requests:
            self.input_batch.add_request(new)
        for hooks in self._hooks:
            hooks.add_requests(self.input_batch, step)
        if step.cached_handles:
            self.input_batch.update_cached(
                unpack_int32(step.cached_handles), unpack_int32(step.cached_num_new_blocks),
                unpack_int32(step.cached_new_block_ids),
                unpack_int32(step.cached_num_computed_tokens))

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        for hooks in self._hooks:
            hooks.prepare_forward(batch, self.input_batch)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        attn_metadata = self.attn_backend.build_metadata(batch.attn)
        inputs_embeds, positions = self._inputs.prepare_inputs(batch, self._embed_input_ids)
        return self.model.forward(batch.input_ids, positions, attn_metadata, inputs_embeds)

    def _capture_cuda_graphs(self) -> None:
        # NOTE: no graphs with LoRA (the token -> slot mapping is not in a captured buffer) nor
        # images (input embeddings and M-RoPE positions are not either) nor a hybrid's states.
        config = self.config
        if (self.device.type == "cuda" and config.enable_cuda_graphs and self.lora is None
                and self.attn_backend.name == "triton" and self.parallel is None
                and self.multimodal is None and self.hybrid is None):
            self.cuda_graphs = CudaGraphRunner(self.model, self.attn_backend, config.max_num_seqs,
                                               self.max_num_blocks_per_req, self.device)
            self.cuda_graphs.capture()

    # ---- sleep mode (runner/sleep_mode.py) and weight updates (runner/weight_update.py)

    def release_model(self) -> None:
        """Drops every reference to the model's weights (the CUDA graphs hold them too)."""
        del self.model
        self.cuda_graphs = None

    def load_model(self, model_dir: Path) -> None:
        """Builds the model anew from `model_dir`'s weights, over the same KV cache."""
        self.swap_model(self.build_model(model_dir))

    def build_model(self, model_dir: Path) -> CausalLM | TensorParallelModel:
        """The model of `model_dir`'s weights, not serving yet."""
        return self._load_model(model_dir)

    def swap_model(self, model: CausalLM | TensorParallelModel) -> None:
        """Serves `model` from the next step on, over the same KV cache."""
        self.model = model
        self.model.bind_kv_caches(self.kv_caches)
        self._capture_cuda_graphs()

    def _embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Called by the images' hooks only: never under tensor parallelism (whose model has
        no embedding lookup of its own), which refuses images."""
        assert isinstance(self.model, LlamaForCausalLM)
        return self.model.embed_input_ids(input_ids)

    @property
    def _max_num_samples(self) -> int:
        """Most positions a step samples at: 1 + drafts per request."""
        spec = self.config.speculative_config
        return self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))

    def _load_model(self, model_dir: Path | None = None) -> CausalLM | TensorParallelModel:
        config = self.config if model_dir is None else replace(self.config, model_dir=model_dir)
        weights = weight_source(config, self.model_config, self.device)
        if self.parallel is not None:
            return self.parallel.build(config, weights, self.attn_backend, self.max_model_len)
        return load_model(config, self.model_config, weights, self.attn_backend,
                          self.max_model_len)

    def close(self) -> None:
        self.structured_outputs.close()
        for hooks in self._hooks:
            hooks.close()
        if self.parallel is not None:
            self.parallel.close()

    def _num_kv_blocks(self, memory_before_load: tuple[int, int] | None) -> int:
        """--kv-cache-memory where set (on an accelerator too, as vLLM's
        --kv-cache-memory-bytes, if it fits). Else on CPU a fraction of available RAM, on an
        accelerator vLLM's rule: utilization x total minus others' use, our weights and peak
        activations."""
        config = self.config
        if memory_before_load is not None:
            free, total = memory_before_load
            budget = accelerator_kv_budget(config.gpu_memory_utilization, total, total - free,
                                           self._profile_peak_bytes())
            if config.kv_cache_memory:
                budget = explicit_accelerator_kv_budget(config.kv_cache_memory, budget,
                                                        config.gpu_memory_utilization)
        else:
            budget = config.kv_cache_memory or int(
                config.kv_cache_memory_fraction * available_cpu_memory())
        is_default_budget = memory_before_load is None and config.kv_cache_memory is None
        return num_blocks_for_budget(self.kv_spec, budget, self.max_model_len,
                                     config.max_num_seqs, is_default_budget,
                                     draft_kv_bytes_per_block(config))

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak device memory of a forward pass at max_num_batched_tokens (weights included),
        run against a throwaway KV cache just big enough for it."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_samples = min(self._max_num_samples, num_tokens)
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = allocate_kv_caches(self.kv_spec, math.ceil(num_tokens / self.block_size) + 1,
                                    self.device)
        self.model.bind_kv_caches(caches)
        batch = dummy_step_batch(num_tokens, self.block_size, self.device)
        if self.hybrid is not None:
            self.hybrid.bind(batch)
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

