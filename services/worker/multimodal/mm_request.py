"""One live request's images as the worker runs them: where each image's embeddings go in the
prompt, the embeddings once resolved, and (Qwen2-VL) the prompt's M-RoPE positions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import unpack_uint8


def embed_positions(item: wire_pb.MultiModalItem) -> np.ndarray:
    """The prompt positions that take the image's embeddings, in the embeddings' order: the
    placeholder run [offset, offset + length), where is_embed says (empty: all of it)."""
    if not item.is_embed:
        return np.arange(item.offset, item.offset + item.length, dtype=np.int64)
    is_embed = unpack_uint8(item.is_embed)
    if len(is_embed) != item.length:
        raise ValueError(f"is_embed has {len(is_embed)} entries for a run of {item.length}")
    return item.offset + np.flatnonzero(is_embed)


@dataclass
class MultiModalRequest:
    items: list[wire_pb.MultiModalItem]          # by offset
    positions: list[np.ndarray]               # per item: embed_positions(item)
    embeds: list[torch.Tensor | None]         # per item: [len(positions), hidden] once resolved
    num_prompt_tokens: int
    mrope: torch.Tensor | None = None         # Qwen2-VL: the prompt's positions [3, prompt]
    mrope_delta: int = 0                      # past the prompt: position = index + delta

    @classmethod
    def of(cls, new: wire_pb.NewRequestData) -> MultiModalRequest:
        items = sorted(new.mm_items, key=lambda i: i.offset)
        return cls(items, [embed_positions(i) for i in items], [None] * len(items),
                   new.num_prompt_tokens)

    def scheduled_embeds(self, start: int, end: int) -> list[tuple[int, np.ndarray]]:
        """(item index, indices into its positions) of the image positions in [start, end)."""
        out = []
        for index, positions in enumerate(self.positions):
            if len(positions) and positions[0] < end and positions[-1] >= start:
                out.append((index, np.flatnonzero((positions >= start) & (positions < end))))
        return out

    def is_computed(self, index: int, num_computed: int) -> bool:
        """Whether every position of the item's image is among the first num_computed."""
        positions = self.positions[index]
        return not len(positions) or positions[-1] < num_computed

    def release_computed(self, num_computed: int) -> None:
        """Drops the embeddings of images whose every position is computed."""
        for index in range(len(self.items)):
            if self.is_computed(index, num_computed):
                self.embeds[index] = None

    def step_positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start] of sequence tokens start..end-1."""
        seq = torch.arange(start, end)
        positions = (seq + self.mrope_delta).expand(3, -1).clone()
        assert self.mrope is not None
        in_prompt = seq < self.num_prompt_tokens
        positions[:, in_prompt] = self.mrope[:, seq[in_prompt]]
        return positions
