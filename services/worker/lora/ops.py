"""The batched LoRA op (Punica's shrink / expand): every row of a flattened batch takes its own
adapter's low-rank update,

    y[t] += scales[s] * (x[t] @ lora_a[s]^T) @ lora_b[s]^T   with s = token_slots[t] (-1: none)

lora_a [num_slots, max_rank, in] and lora_b [num_slots, out, max_rank] hold every slot's pair,
zero-padded past its rank (padding adds exact zeros). The implementations:
- ref_lora_add: the torch reference, one gathered pair per row (obviously right, slow);
- grouped_lora_add, the CPU path for one adapter or many rows: rows grouped by slot once per
  step (LoraBatch), then two GEMMs per group on its own pair cut to its rank (index_add_ back);
- masked_lora_add, the CPU path for a few rows over several adapters: two GEMMs in all, every
  row through all the slots' A, the other slots' columns zeroed, then all the slots' B;
- kernels/triton_lora.py: the GPU kernels, one row per program (Punica's BGMV).

NOTE: measured with `python -m benchmarks.lora_ops` (2 cores, fp32, one SmolLM2-135M
layer's four linears, rank 16 on all seven projections, rows spread over 4 slots and the base;
other jobs were loading the machine, so +-30%), microseconds per layer:
    rows / adapters   base linears   grouped   masked   reference
    8 / 4 + base           473          640       286       2207
    32 / 4 + base         1659         1176       613       7360
    32 / 1                1636          232       580       5828
    64 / 4 + base         2904         1067       966       9019
    128 / 4 + base        4927         1414      2334      32295
    512 / 4 + base       18662        23595     46913     526415
Hence masked up to MASKED_MAX_ROWS rows when a step mixes adapters, grouped otherwise: 4-30x
faster than the reference. Rank 16 on every projection of 4 adapters is the heavy case (the
slots' pairs are ~28% of the layer's weight bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

NO_SLOT = -1   # a row of the base model
# Rows up to which a step over several adapters takes masked_lora_add (measured above).
MASKED_MAX_ROWS = 64
# A request running at least this many rows in a step (a prefill chunk) over several
# adapters gets its own two GEMMs on a slice of the rows: no gather, no scatter.
SEGMENT_MIN_ROWS = 16


@dataclass(frozen=True)
class LoraBatch:
    """One step's rows -> slots, in the forms the implementations read."""
    token_slots: torch.Tensor                           # int32 [num_tokens], NO_SLOT: base
    groups: tuple[tuple[int, torch.Tensor | None], ...]  # (slot, its rows; None: all rows)
    row_scales: torch.Tensor | None
    """[num_rows, num_slots, 1] for masked_lora_add: each row's own slot's scale, zero in
    the others' (made once per step: every wrapped linear reads it); None: another path.
    With segments, the rows are those of `rest_rows`."""
    segments: tuple[tuple[int, int, int], ...] = ()
    """(start, end, slot): a request's run of SEGMENT_MIN_ROWS rows or more (segment path)."""
    rest_rows: torch.Tensor | None = None
    """With segments: the other rows that take an adapter (a masked pass over them)."""

    @classmethod
    def from_slots(cls, token_slots: np.ndarray, slot_scales: Sequence[float],
                   device: torch.device, query_lens: np.ndarray | None = None) -> LoraBatch:
        """slot_scales: each slot's adapter's scale (its length is the number of slots);
        query_lens: each request's rows, in order (None: no request runs a segment)."""
        slots = np.unique(token_slots)
        groups: tuple = ()   # the GPU kernels read token_slots only
        row_scales = None
        if device.type == "cpu" and len(slots) == 1 and slots[0] != NO_SLOT:
            groups = ((int(slots[0]), None),)
        elif (device.type == "cpu" and query_lens is not None
              and (query_lens >= SEGMENT_MIN_ROWS).any()):
            return cls._with_segments(token_slots, slot_scales, device, query_lens)
        elif device.type == "cpu":
            groups = tuple((int(s), torch.from_numpy(np.flatnonzero(token_slots == s)))
                           for s in slots if s != NO_SLOT)
            if len(token_slots) <= MASKED_MAX_ROWS:
                onehot = token_slots[:, None] == np.arange(len(slot_scales))
                row_scales = torch.from_numpy(
                    (onehot * np.asarray(slot_scales, dtype=np.float32))[:, :, None])
        return cls(torch.from_numpy(token_slots.astype(np.int32)).to(device), groups, row_scales)

    @classmethod
    def _with_segments(cls, token_slots: np.ndarray, slot_scales: Sequence[float],
                       device: torch.device, query_lens: np.ndarray) -> LoraBatch:
        """A step with prefill chunks over several adapters: each chunk a segment, the
        decodes' rows one masked pass (the grouped path's gathers and scatters per slot
        cost more than the GEMMs at these sizes)."""
        starts = np.cumsum(query_lens) - query_lens
        request_slots = token_slots[starts]
        is_long = query_lens >= SEGMENT_MIN_ROWS
        segments = tuple((int(start), int(start + n), int(slot)) for start, n, slot, long in
                         zip(starts, query_lens, request_slots, is_long)
                         if long and slot != NO_SLOT)
        rest = np.flatnonzero(~np.repeat(is_long, query_lens) & (token_slots != NO_SLOT))
        onehot = token_slots[rest, None] == np.arange(len(slot_scales))
        row_scales = torch.from_numpy(
            (onehot * np.asarray(slot_scales, dtype=np.float32))[:, :, None])
        return cls(torch.from_numpy(token_slots.astype(np.int32)).to(device), (), row_scales,
                   segments, torch.from_numpy(rest))


def ref_lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, token_slots: torch.Tensor) -> None:
    """The reference: adds each row's update to y in place (fp32 math, one rounding)."""
    rows = torch.nonzero(token_slots >= 0).flatten()
    slots = token_slots[rows].long()
    shrunk = torch.einsum("ti,tri->tr", x[rows].float(), lora_a[slots].float())
    expanded = torch.einsum("tr,tor->to", shrunk, lora_b[slots].float())
    y[rows] = (y[rows].float() + expanded * scales[slots].float()[:, None]).to(y.dtype)


def grouped_lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, scales: list[float], ranks: list[int],
                     groups: tuple[tuple[int, torch.Tensor | None], ...]) -> None:
    """The CPU path: two GEMMs per slot over its rows, at the slot's rank (`ranks[s]`, 0 where
    the slot's adapter leaves this linear alone)."""
    for slot, rows in groups:
        rank = ranks[slot]
        if rank == 0:
            continue
        a, b = lora_a[slot, :rank], lora_b[slot, :, :rank]
        if rows is None:
            y.addmm_(x @ a.t(), b.t(), alpha=scales[slot])
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t(),
                         alpha=scales[slot])


def segment_lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, scales: list[float], ranks: list[int],
                     lora_a_t: torch.Tensor, lora_b_t: torch.Tensor, batch: LoraBatch) -> None:
    """The CPU path for a step with prefill chunks over several adapters: two GEMMs on each
    chunk's slice of rows at its slot's rank, then the other rows gathered through
    masked_lora_add and added back."""
    for start, end, slot in batch.segments:
        rank = ranks[slot]
        if rank:
            y[start:end].addmm_(x[start:end] @ lora_a[slot, :rank].t(),
                                lora_b[slot, :, :rank].t(), alpha=scales[slot])
    rest = batch.rest_rows
    if rest is not None and len(rest):
        assert batch.row_scales is not None
        update = torch.zeros(len(rest), y.shape[1], dtype=y.dtype)
        masked_lora_add(update, x.index_select(0, rest), lora_a_t, lora_b_t, batch.row_scales)
        y.index_add_(0, rest, update)


def masked_lora_add(y: torch.Tensor, x: torch.Tensor, lora_a_t: torch.Tensor,
                    lora_b_t: torch.Tensor, row_scales: torch.Tensor) -> None:
    """The CPU path for a few rows over several adapters: every row through all the slots'
    A in one GEMM (lora_a_t [in, S * R]: lora_a [S, R, in] viewed flat, transposed), each
    row's other slots zeroed and its own scaled (row_scales [T, S, 1]), then one GEMM through
    all the slots' B side by side (lora_b_t [S * R, out]: lora_b_by_out [out, S, R] viewed
    flat, transposed). NOTE: three ops per linear: at a few rows the dispatch of each op, not
    the arithmetic, is what a decode step pays."""
    shrunk = x @ lora_a_t
    shrunk.view(len(x), row_scales.shape[1], -1).mul_(row_scales)
    y.addmm_(shrunk, lora_b_t)
