"""The ranks of a tensor-parallel engine. Rank 0 is the worker: it runs its model runner as
always, but its model is a TensorParallelModel that first sends each call (forward, logits,
KV cache binding) to the follower ranks, which run the same call on their shards; the
collectives inside the layers keep the ranks in step. Only rank 0 samples.

Followers are processes started by rank 0 (spawned: a fresh interpreter, never a fork of a
process with threads). A follower that dies takes the worker down with it (rank 0 would
wait for it in the next collective), so the worker's supervisor restarts the engine whole;
a follower whose rank 0 is gone reads end-of-file on its command pipe, or is killed with
its parent, and exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog
import torch

from services.common.ports import free_port
from services.worker.attention.backend import AttentionBackend, KVCache
from services.worker.kv.kv_cache import allocate_kv_caches
from services.worker.models.checkpoint_quant import read_checkpoint_quant
from services.worker.models.config import ModelConfig
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.weights import WeightSource
from services.worker.parallel.commands import CommandSender, decode
from services.worker.parallel.group import TensorParallelGroup, rank_cores
from services.worker.parallel.layers import parallelize
from services.worker.parallel.sharding import ShardedWeights, ShardPlan
from services.worker.parallel.shm_collectives import SharedMemoryCollectives, new_segment_path
from services.worker.runner.config import RunnerConfig
from services.worker.runner.cpu_runtime import configure_cpu_runtime
from services.worker.runner.model_loader import (
    attention_backend,
    kv_cache_spec,
    load_model,
    max_model_len,
    resolve_device,
)

log = structlog.get_logger(__name__)

# NOTE: the bound of every collective; a rank that dies is noticed by its process ending.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
_PR_SET_PDEATHSIG = 1
EXIT_CODE_RANK_LOST = 70


class TensorParallelModel:
    """Rank 0's model: each call goes to the followers first, then runs here."""

    def __init__(self, model: LlamaForCausalLM, commands: CommandSender):
        self.model = model
        self.commands = commands

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        assert inputs_embeds is None, "images are refused under tensor parallelism"
        self.commands.send(("forward", input_ids, positions, attn_metadata))
        return self.model.forward(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # NOTE: the rows sampled at (a few KB), not their indices into the last forward:
        # the profiling and speculative paths pick rows of their own.
        self.commands.send(("logits", hidden))
        return self.model.compute_logits(hidden)

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None:
        self.commands.send(("bind_kv_caches", kv_caches[0].key.shape[0]))
        self.model.bind_kv_caches(kv_caches)

    def __getattr__(self, name: str) -> Any:   # layers, num_bytes, ...: the local model's
        return getattr(self.model, name)


class TensorParallelRanks:
    """Rank 0's side: starts the followers and joins the group with them."""

    def __init__(self, config: RunnerConfig, model_config: ModelConfig, device: torch.device):
        self.world_size = config.tensor_parallel_size
        self.plan = ShardPlan.of(model_config, 0, self.world_size)   # refuses before spawning
        stored = read_checkpoint_quant(config.model_dir)
        if stored is not None:   # its packed tensors would need slicing scheme by scheme
            raise ValueError(f"tensor parallelism runs unquantized checkpoints; this one is "
                             f"stored {stored.method}-quantized (use --tensor-parallel-size 1)")
        self._affinity = os.sched_getaffinity(0)   # before rank 0 keeps to its own cores
        self._closing = False
        init_method = f"tcp://127.0.0.1:{free_port()}"
        shm_path = new_segment_path() if device.type == "cpu" else None
        shm = (SharedMemoryCollectives(shm_path, 0, self.world_size, create=True)
               if shm_path is not None else None)
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, self.world_size)]
        self.followers = [
            context.Process(target=follower_main, name=f"tp-rank-{rank}", daemon=True,
                            args=(config, rank, init_method, shm_path, reader))
            for rank, (reader, _) in enumerate(pipes, start=1)]
        try:
            for process in self.followers:
                process.start()
            for reader, _ in pipes:
                reader.close()   # the followers hold it now: rank 0 dying closes their pipe
            log.info("tensor parallel ranks started", world_size=self.world_size,
                     backend="nccl" if device.type == "cuda" else "gloo",
                     shared_memory=shm is not None,
                     follower_pids=[p.pid for p in self.followers])
            # Watching from the start: a follower that fails to load must not leave rank 0
            # waiting for it to join.
            threading.Thread(target=self._watch_followers, name="tp-watchdog",
                             daemon=True).start()
            self.group = TensorParallelGroup.join(0, self.world_size, init_method,
                                                  use_rank_device(device, 0),
                                                  COLLECTIVE_TIMEOUT, shm)
        finally:
            if shm_path is not None:   # every rank has it mapped (or never will)
                shm_path.unlink()
        # Device tensors go to the followers' own GPUs by broadcast; on CPU, in the pickle.
        self.commands = CommandSender([writer for _, writer in pipes], self.group,
                                      by_broadcast="cuda" if device.type == "cuda" else None)

    def build(self, config: RunnerConfig, weights: WeightSource, attn: AttentionBackend,
              max_model_len: int) -> TensorParallelModel:
        model = build_shard(config, self.plan, weights, attn, max_model_len, self.group)
        return TensorParallelModel(model, self.commands)

    def close(self) -> None:
        self._closing = True
        self.commands.close()   # followers read end-of-file and stop
        for process in self.followers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        self.group.close()
        os.sched_setaffinity(0, self._affinity)

    def _watch_followers(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.followers])
        if self._closing:
            return
        lost = [(p.name, p.exitcode) for p in self.followers if p.exitcode is not None]
        log.error("a tensor-parallel rank exited; the worker exits so the engine restarts whole",
                  ranks=lost)
        os._exit(EXIT_CODE_RANK_LOST)


def build_shard(config: RunnerConfig, plan: ShardPlan, weights: WeightSource,
                attn: AttentionBackend, max_model_len: int,
                group: TensorParallelGroup) -> LlamaForCausalLM:
    """This rank's model (its heads, MLP columns and vocabulary rows), collectives in place."""
    # NOTE: no GGUF-block path: a rank's slice of a row-parallel weight cuts the blocks.
    model = load_model(config, plan.rank_config, ShardedWeights(weights, plan), attn,
                       max_model_len, use_gguf_blocks=False)
    parallelize(model, plan, group)
    return model


def pin_rank_cores(config: RunnerConfig, rank: int) -> int:
    """This rank's torch threads: an equal share of the engine's (--num-threads, else every
    core). An engine that has the machine to itself also keeps each rank on its own cores,
    so the ranks' threads never compete for one (and a rank spinning in a shared-memory
    collective takes no other rank's core); engines sharing it (--data-parallel-size) are
    left where the OS puts them."""
    world_size = config.tensor_parallel_size
    available = len(os.sched_getaffinity(0))
    engine_threads = config.num_threads or available
    cores = rank_cores(rank, world_size)
    if engine_threads >= available and cores is not None:
        os.sched_setaffinity(0, cores)
    return max(1, engine_threads // world_size)


def follower_main(config: RunnerConfig, rank: int, init_method: str, shm_path: Path | None,
                  commands: Connection) -> None:
    """A follower rank: builds its shard, then runs what rank 0 sends until rank 0 closes
    its pipe (or dies)."""
    _die_with_parent()
    device = use_rank_device(resolve_device(config.device), rank)
    if device.type == "cpu":
        configure_cpu_runtime(pin_rank_cores(config, rank))
    torch.manual_seed(config.seed)
    shm = (SharedMemoryCollectives(shm_path, rank, config.tensor_parallel_size, create=False)
           if shm_path is not None else None)
    group = TensorParallelGroup.join(rank, config.tensor_parallel_size, init_method, device,
                                     COLLECTIVE_TIMEOUT, shm)
    model_config = ModelConfig.from_hf_dir(config.model_dir)
    plan = ShardPlan.of(model_config, rank, config.tensor_parallel_size)
    model = build_shard(config, plan, WeightSource(config.model_dir, config.torch_dtype, device),
                        attention_backend(config, plan.rank_config, device),
                        max_model_len(config.max_model_len, model_config), group)
    spec = kv_cache_spec(config, plan.rank_config)
    try:
        with torch.inference_mode():
            while True:
                command, *args = decode(commands.recv_bytes(), group)
                if command == "forward":
                    model.forward(*args)
                elif command == "logits":
                    model.compute_logits(*args)
                elif command == "bind_kv_caches":
                    model.bind_kv_caches(allocate_kv_caches(spec, args[0], device))
    except EOFError:
        pass   # rank 0 closed the pipe: the engine is stopping
    finally:
        group.close()


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (rank 0) dies, however it dies (Linux).
    NOTE: strictly, when the thread that started it ends: the worker starts its ranks on
    its step thread, which lives as long as the worker."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def use_rank_device(device: torch.device, rank: int) -> torch.device:
    """This rank's device: GPU `rank`, made the process's current device, since Triton
    launches and NCCL streams follow the current device, not a tensor's (rank 1 would
    otherwise run its kernels on GPU 0); on CPU, the CPU."""
    if device.type != "cuda":
        return device
    rank_device = torch.device("cuda", rank)
    torch.cuda.set_device(rank_device)
    return rank_device
