"""The scheduler's engine core: requests, KV block pool, prefix cache and the step policy.

Pure Python with no I/O (no NATS, asyncio, torch or wire types), so it is tested without a
model: the service wraps it, packing `SchedulerOutput` into the wire's `StepInput` and
unpacking `StepOutput` into `RunnerOutput`. Layers, top to bottom (as in vLLM V1):
Scheduler -> KVCacheManager -> BlockPool -> FreeKVCacheBlockQueue.
"""

from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.errors import AdmissionRejected, RequestTooLong
from services.scheduler.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from services.scheduler.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from services.scheduler.core.output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from services.scheduler.core.request import FinishReason, Request, RequestStatus
from services.scheduler.core.scheduler import Scheduler

__all__ = [
    "AdmissionRejected", "AllBlocksCleared", "BlockRemoved", "BlockStored", "CachedRequestData",
    "EngineCoreOutput", "FinishReason", "KVCacheBlocks", "KVCacheEvent", "KVCacheManager",
    "NewRequestData", "Request", "RequestStatus", "RequestTooLong", "RunnerOutput", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SchedulerStats",
]
