"""A linear layer that adds, to each row, the low-rank update of that row's adapter.

It wraps one of the model's linears (layers.Linear or a quantized one) and holds `max_loras`
slots of LoRA pairs for it; which slot each row of a step uses is the shared LoraMapping's,
set once per step (LoraManager.prepare_step) and read by every wrapped linear.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.lora.adapter import LoraWeights
from services.worker.lora.ops import (LoraBatch, grouped_lora_add, masked_lora_add,
                                      segment_lora_add)


class LoraMapping:
    """This step's rows -> slots, or None while no row of the step uses an adapter."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraLinear:
    def __init__(self, base: Callable[[torch.Tensor], torch.Tensor], in_features: int,
                 out_features: int, max_loras: int, max_rank: int, mapping: LoraMapping,
                 dtype: torch.dtype, device: torch.device):
        """max_rank: the widest pair a slot holds (a fused linear's parts side by side)."""
        self.base = base
        self.mapping = mapping
        self.lora_a = torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device)
        # NOTE: B stored [out, slot, rank], so that all the slots' B side by side is a view
        # (masked_lora_add); lora_b is the [slot, out, rank] view of it the others read.
        self.lora_b_by_out = torch.zeros(out_features, max_loras, max_rank, dtype=dtype,
                                         device=device)
        self.lora_b = self.lora_b_by_out.permute(1, 0, 2)
        # All the slots' pairs side by side, transposed for masked_lora_add (views: set_slot's
        # in-place copies show through).
        self._lora_a_t = self.lora_a.view(max_loras * max_rank, in_features).t()
        self._lora_b_t = self.lora_b_by_out.view(out_features, max_loras * max_rank).t()
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        # NOTE: host copies of the scales and ranks: the CPU path reads them per group, and a
        # device tensor's item() would synchronize there.
        self.slot_scales = [0.0] * max_loras
        self.slot_ranks = [0] * max_loras
        self._add = self._add_on_cpu
        if device.type != "cpu":
            from kernels.triton_lora import lora_add   # NOTE: triton loads where a GPU runs it
            self._triton_lora_add = lora_add
            self._add = self._add_with_triton

    @property
    def num_bytes(self) -> int:
        return self.base.num_bytes

    @property
    def num_bytes_per_small_batch(self) -> int:
        return self.base.num_bytes_per_small_batch

    def set_slot(self, slot: int, weights: LoraWeights | None, scaling: float) -> None:
        """Puts an adapter's pair for this linear in `slot` (None: the adapter leaves it
        alone, so the slot adds nothing here)."""
        rank = 0 if weights is None else weights.rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            self.lora_a[slot, :rank].copy_(weights.lora_a)
            self.lora_b[slot, :, :rank].copy_(weights.lora_b)
        self.scales[slot] = scaling
        self.slot_scales[slot] = scaling
        self.slot_ranks[slot] = rank

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.mapping.batch
        # NOTE: a linear no placed adapter targets (o_proj under a q/v adapter) costs nothing.
        if batch is not None and any(self.slot_ranks):
            self._add(y, x, batch)
        return y

    def _add_on_cpu(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        if batch.rest_rows is not None:   # the step took the segment path
            segment_lora_add(y, x, self.lora_a, self.lora_b, self.slot_scales, self.slot_ranks,
                             self._lora_a_t, self._lora_b_t, batch)
            return
        if batch.row_scales is not None:
            masked_lora_add(y, x, self._lora_a_t, self._lora_b_t, batch.row_scales)
            return
        grouped_lora_add(y, x, self.lora_a, self.lora_b, self.slot_scales, self.slot_ranks,
                         batch.groups)

    def _add_with_triton(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        self._triton_lora_add(y, x, self.lora_a, self.lora_b, self.scales, batch.token_slots)
