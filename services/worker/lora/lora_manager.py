"""Which adapters the worker knows, keeps in host memory and has placed in the model's slots.

Three tiers, S-LoRA's paging with vLLM's knobs:
- registered: lora_id -> adapter directory (add_adapter checks that it fits the model);
- host memory: up to max_cpu_loras loaded adapters, least recently used dropped first (read
  from disk again when next needed);
- slots: max_loras places in every LoraLinear. A step's adapters are placed before its forward
  pass (prepare_step); a slot is reused least recently used first, never one the step needs.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from services.worker.lora.adapter import LoraAdapter, LoraError, LoraTarget, load_peft_adapter
from services.worker.lora.lora_linear import LoraLinear, LoraMapping
from services.worker.lora.ops import NO_SLOT, LoraBatch

BASE_LORA_ID = 0   # the wire's "no adapter" (proto3's zero)


class LoraManager:
    def __init__(self, linears: dict[tuple[int, str], LoraLinear],
                 layer_targets: list[dict[str, LoraTarget]], mapping: LoraMapping,
                 max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device):
        if max_cpu_loras < max_loras:
            raise LoraError(f"--max-cpu-loras {max_cpu_loras} is below --max-loras {max_loras}")
        self.linears = linears
        self.layer_targets = layer_targets
        self.mapping = mapping
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.lora_id_to_path: dict[int, Path] = {}
        self.host_adapters: OrderedDict[int, LoraAdapter] = OrderedDict()   # LRU first
        self.lora_id_to_slot: OrderedDict[int, int] = OrderedDict()          # LRU first
        self.slot_scales = [0.0] * max_loras   # the scale of each slot's adapter
        self.num_disk_loads = 0

    def add_adapter(self, lora_id: int, path: Path) -> None:
        """Registers an adapter, read and checked now (LoraError if it does not fit)."""
        if lora_id == BASE_LORA_ID:
            raise LoraError(f"lora_id {BASE_LORA_ID} is the base model's")
        self.remove_adapter(lora_id)
        self._load(lora_id, path)
        self.lora_id_to_path[lora_id] = path

    def remove_adapter(self, lora_id: int) -> None:
        self.lora_id_to_path.pop(lora_id, None)
        self.host_adapters.pop(lora_id, None)
        self.lora_id_to_slot.pop(lora_id, None)   # its slot is free for the next adapter

    def prepare_step(self, lora_ids: np.ndarray, query_lens: np.ndarray) -> None:
        """Places the step's adapters (one id per request, BASE_LORA_ID for none) and maps
        each of the step's tokens to its request's slot, for every LoraLinear."""
        self.mapping.batch = None   # NOTE: a step refused below must not run last step's map
        step_ids = set(np.unique(lora_ids).tolist()) - {BASE_LORA_ID}
        if not step_ids:
            return
        if len(step_ids) > self.max_loras:
            raise LoraError(f"a step uses {len(step_ids)} adapters, over --max-loras "
                            f"{self.max_loras}")
        id_to_slot = {lora_id: self._place(lora_id, step_ids) for lora_id in step_ids}
        id_to_slot[BASE_LORA_ID] = NO_SLOT
        request_slots = np.fromiter((id_to_slot[i] for i in lora_ids.tolist()), np.int32,
                                    len(lora_ids))
        self.mapping.batch = LoraBatch.from_slots(np.repeat(request_slots, query_lens),
                                                  self.slot_scales, self.device, query_lens)

    def _place(self, lora_id: int, step_ids: set[int]) -> int:
        """The adapter's slot, filling a free one or the least recently used one the step
        does not need."""
        slot = self.lora_id_to_slot.get(lora_id)
        if slot is not None:
            self.lora_id_to_slot.move_to_end(lora_id)
            return slot
        adapter = self._host_adapter(lora_id)
        used = set(self.lora_id_to_slot.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.lora_id_to_slot if i not in step_ids)
            slot = self.lora_id_to_slot.pop(victim)
        for key, linear in self.linears.items():
            linear.set_slot(slot, adapter.weights.get(key), adapter.scaling)
        self.slot_scales[slot] = adapter.scaling
        self.lora_id_to_slot[lora_id] = slot
        return slot

    def _host_adapter(self, lora_id: int) -> LoraAdapter:
        adapter = self.host_adapters.get(lora_id)
        if adapter is not None:
            self.host_adapters.move_to_end(lora_id)
            return adapter
        path = self.lora_id_to_path.get(lora_id)
        if path is None:
            raise LoraError(f"unknown adapter lora_id {lora_id}")
        return self._load(lora_id, path)

    def _load(self, lora_id: int, path: Path) -> LoraAdapter:
        """Reads the adapter from disk into host memory, dropping the least recently used."""
        adapter = load_peft_adapter(path, self.layer_targets, self.max_rank, self.dtype)
        self.num_disk_loads += 1
        self.host_adapters[lora_id] = adapter
        while len(self.host_adapters) > self.max_cpu_loras:
            self.host_adapters.popitem(last=False)
        return adapter
