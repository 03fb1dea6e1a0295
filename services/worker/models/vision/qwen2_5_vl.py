"""Qwen2.5-VL's vision tower: Qwen2-VL's (qwen2_vl.py) with two changes.

- The blocks use RMSNorm and a SwiGLU MLP with biases; the merger's norm is an RMSNorm.
- Window attention: every block but `fullatt_block_indexes` attends only within windows of
  window_size pixels. The tower reorders the merge blocks once so each window is contiguous
  (the window_index), runs every block in that order, and restores the processor's order
  after the merger.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.models.layers import Linear
from services.worker.models.vision.qwen2_vl import (
    QwenVisionBlock, QwenVisionConfig, Qwen2VLVisionEncoder)
from services.worker.models.vision.qwen2_vl_grid import Grid, image_cu_seqlens, window_index
from services.worker.models.vision.vision_layers import RMSNorm, activation, linear
from services.worker.models.vision.vision_weights import VisionWeights


class SwiGluMlp:
    """down(act(gate(x)) * up(x)), gate and up as one fused linear."""

    def __init__(self, weights: VisionWeights, prefix: str, hidden_act: str):
        names = [f"{prefix}.{p}" for p in ("gate_proj", "up_proj")]
        fused = torch.cat([weights.get(n + ".weight") for n in names])
        bias = torch.cat([weights.get(n + ".bias") for n in names]) if all(
            n + ".bias" in weights for n in names) else None
        self.gate_up = Linear(fused, bias)
        self.down = linear(weights, prefix + ".down_proj")
        self.act = activation(hidden_act)
        self.size = fused.shape[0] // 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        return self.down(self.act(gate_up[:, :self.size]) * gate_up[:, self.size:])


class Qwen2_5_VLVisionBlock(QwenVisionBlock):
    norm_cls = RMSNorm

    def _mlp(self, config: QwenVisionConfig, weights: VisionWeights, prefix: str) -> SwiGluMlp:
        return SwiGluMlp(weights, prefix, config.hidden_act)


class Qwen2_5_VLVisionEncoder(Qwen2VLVisionEncoder):
    block_cls = Qwen2_5_VLVisionBlock

    def _attention_segments(
            self, grids: Sequence[Grid]) -> tuple[torch.Tensor | None, list[list[int]]]:
        config = self.config
        assert config.window_size is not None
        order, windows = window_index(grids, config.spatial_merge_size, config.window_size,
                                      config.patch_size)
        # NOTE: the reordering keeps each image's patches together, so whole-image segments
        # are unchanged by it.
        images = image_cu_seqlens(grids)
        return order, [images if i in config.fullatt_block_indexes else windows
                       for i in range(len(self.blocks))]
