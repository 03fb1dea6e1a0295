"""Multi-LoRA in the scheduler: no step may mix more adapters than the worker has slots
(--max-loras), and the adapters the worker holds in memory are advertised to routers.

The rule is kept over the running batch, not per step: a waiting request whose adapter is
not running yet starts only while fewer than max_loras adapters run, so every step, whatever
subset of the batch it schedules, fits the worker's slots. Requests it skips keep their
place in the queue (vLLM's scheduler skips them the same way).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from services.scheduler.core.request import Request, RequestStatus

_HOLDING = (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)


class LoraSlots:
    def __init__(self, max_loras: int, max_cpu_loras: int = 0) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self._recent: OrderedDict[int, None] = OrderedDict()   # least recently used first

    @staticmethod
    def active(requests: Iterable[Request]) -> set[int]:
        """The adapters of the requests holding a place in the batch."""
        return {r.lora_id for r in requests if r.lora_id and r.status in _HOLDING}

    def admits(self, active: set[int], lora_id: int) -> bool:
        return not lora_id or lora_id in active or len(active) < self.max_loras

    def sent(self, lora_id: int) -> None:
        """A request with this adapter went to the worker: it holds the adapter now."""
        if not lora_id:
            return
        self._recent[lora_id] = None
        self._recent.move_to_end(lora_id)
        while len(self._recent) > self.max_cpu_loras:
            self._recent.popitem(last=False)

    @property
    def held(self) -> list[int]:
        """The adapters the worker most likely holds in host memory, most recent last (it
        keeps max_cpu_loras, least recently used dropped first, as this list does)."""
        return list(self._recent)
