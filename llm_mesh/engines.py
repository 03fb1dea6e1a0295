"""`llm-mesh up --data-parallel-size N`: the settings of each of N engines (a scheduler and its
worker, paired by engine id) sharing one machine: its own id, a share of the cores, and a
share of the memory the KV cache may take by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.settings import EngineSettings
from services.worker.settings import WorkerSettings

# The services started once per engine; the others once per mesh.
ENGINE_SERVICES = ("scheduler", "worker")


@dataclass(frozen=True)
class EnginePlan:
    engine_id: str
    # Settings this engine's services get over the user's flags (each service takes the
    # ones it declares: the scheduler just the id).
    overrides: dict[str, Any]


def plan_engines(worker: WorkerSettings, count: int, cores: int,
                 enable_kv_events: bool | None = None) -> list[EnginePlan]:
    """`count` engines on a machine with `cores` cores, from the worker settings the user
    gave (flags over LLM_MESH_* variables over defaults).

    Ids: the worker's --engine-id for one engine (today's behaviour); for more, that id
    (by default "engine") suffixed -0 ... -{count-1}. Threads: --num-threads if given, else
    an equal share of the cores. KV cache: an explicit --kv-cache-memory is per engine, as
    given; the shares of the machine's memory (--kv-cache-memory-fraction on CPU,
    --gpu-memory-utilization on an accelerator) are divided among the engines, each of
    which would otherwise size its cache as if it had the machine to itself. KV events:
    as given, else on with more than one engine, so the gateways route each request to
    the engine holding its prefix (docs/operations.md, "Routing").
    """
    if count == 1:
        ids = [worker.engine_id]
    else:
        prefix = "engine" if worker.engine_id == EngineSettings.engine_id else worker.engine_id
        ids = [f"{prefix}-{i}" for i in range(count)]
    shared: dict[str, Any] = {"num_threads": threads_per_engine(worker, count, cores),
                              "enable_kv_events": (count > 1 if enable_kv_events is None
                                                   else enable_kv_events)}
    if not worker.kv_cache_memory:
        shared["kv_cache_memory_fraction"] = worker.kv_cache_memory_fraction / count
        shared["gpu_memory_utilization"] = worker.gpu_memory_utilization / count
    return [EnginePlan(engine_id, {**shared, "engine_id": engine_id}) for engine_id in ids]


def threads_per_engine(worker: WorkerSettings, count: int, cores: int) -> int:
    """Torch/OpenMP threads of each worker: the user's --num-threads, else the cores split
    evenly (at least one each: with more engines than cores they share them)."""
    return worker.num_threads or max(1, cores // count)
