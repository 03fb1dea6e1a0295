"""Qwen2-VL's vision tower and PatchMerger: pixel patches -> image embeddings in the text
model's hidden size.

pixel_values [num_patches, C * T * P * P] (the image processor's flattened patches, every
image's in turn) -> patch embed (the Conv3d, whose stride equals its kernel, is a linear over
each flattened patch) -> `depth` pre-norm blocks whose attention stays within one image (2D
rotary over each patch's row and column) -> PatchMerger (LayerNorm, then each m x m block of
patches concatenated and projected by a 2-layer MLP) -> [num_patches / m^2, hidden] split per
image. Qwen2.5-VL changes the blocks and adds window attention (qwen2_5_vl.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.models.layers import Linear
from services.worker.models.vision.qwen2_vl_grid import (
    Grid, image_cu_seqlens, num_image_tokens, patch_positions)
from services.worker.models.vision.vision_layers import (
    LayerNorm, Mlp, RMSNorm, linear, segment_attention)
from services.worker.models.vision.vision_weights import VisionWeights

PREFIX = "visual."
NORM_EPS = 1e-6   # fixed in HF's Qwen2-VL / Qwen2.5-VL towers, not read from the config


@dataclass(frozen=True)
class QwenVisionConfig:
    """A Qwen2-VL / Qwen2.5-VL tower's shape (HF's defaults where config.json leaves one out)."""
    depth: int
    embed_dim: int              # the tower's width
    num_heads: int
    intermediate_size: int      # each block's MLP
    out_hidden_size: int        # the text model's hidden size (the merger's output)
    hidden_act: str
    # The processor's patches: in_channels x temporal_patch_size x patch_size^2 values each.
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int     # m x m patches merge into one text token
    rope_theta: float
    # Qwen2.5-VL: window attention in every block but these, windows of window_size pixels.
    window_size: int | None = None
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, model_type: str, vision: dict[str, Any]) -> QwenVisionConfig:
        """From config.json's `vision_config` of a qwen2_vl or qwen2_5_vl model."""
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        common = dict(patch_size=vision.get("patch_size", 14),
                      temporal_patch_size=vision.get("temporal_patch_size", 2),
                      in_channels=vision.get("in_channels", 3),
                      spatial_merge_size=vision.get("spatial_merge_size", 2), rope_theta=theta)
        if model_type == "qwen2_5_vl":
            # NOTE: here hidden_size is the tower's width and out_hidden_size the text model's.
            return cls(depth=vision.get("depth", 32), embed_dim=vision.get("hidden_size", 3584),
                       num_heads=vision.get("num_heads", 16),
                       intermediate_size=vision.get("intermediate_size", 3420),
                       out_hidden_size=vision.get("out_hidden_size", 3584),
                       hidden_act=vision.get("hidden_act", "silu"),
                       window_size=vision.get("window_size", 112),
                       fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes",
                                                              (7, 15, 23, 31))), **common)
        embed_dim = vision.get("embed_dim", 1280)
        return cls(depth=vision.get("depth", 32), embed_dim=embed_dim,
                   num_heads=vision.get("num_heads", 16),
                   intermediate_size=int(embed_dim * vision.get("mlp_ratio", 4)),
                   out_hidden_size=vision.get("hidden_size", 3584),
                   hidden_act=vision.get("hidden_act", "quick_gelu"), **common)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


class VisionRotary:
    """2D rope: the first half of each head's rotary angles follow the patch's row, the
    second half its column (each at head_dim / 4 frequencies), rotate_half style."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        spatial_dim = head_dim // 2
        exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float32) / spatial_dim
        self.inv_freq = (1.0 / theta ** exponents).to(device)
        half = head_dim // 2
        # NOTE: rotate_half's sign folded into sin, so rotating is x*cos + roll(x)*sin.
        self.sign = torch.cat((-torch.ones(half), torch.ones(half))).to(device)
        self.half = half

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [num_patches, 1, head_dim] for (row, column) positions [N, 2]."""
        freqs = positions.to(self.inv_freq.device)[..., None].float() * self.inv_freq
        angles = freqs.flatten(1)                    # [N, head_dim / 2]: rows', then columns'
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().unsqueeze(1), (angles.sin() * self.sign).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] rotated in fp32 (as HF does), returned in x's dtype."""
        x32 = x.float()
        return (x32 * cos + torch.roll(x32, self.half, dims=-1) * sin).to(x.dtype)


class QwenVisionBlock:
    """x + attn(norm1(x)); x + mlp(norm2(x)). Qwen2-VL: LayerNorms and a plain MLP."""
    norm_cls: type[LayerNorm | RMSNorm] = LayerNorm   # the block's and the merger's norms

    def __init__(self, config: QwenVisionConfig, weights: VisionWeights, prefix: str):
        self.norm1 = self.norm_cls(weights, prefix + "norm1", NORM_EPS)
        self.norm2 = self.norm_cls(weights, prefix + "norm2", NORM_EPS)
        self.qkv = linear(weights, prefix + "attn.qkv")
        self.proj = linear(weights, prefix + "attn.proj")
        self.mlp = self._mlp(config, weights, prefix + "mlp")
        self.num_heads = config.num_heads
        self.scale = config.head_dim ** -0.5

    def _mlp(self, config: QwenVisionConfig, weights: VisionWeights, prefix: str) -> Mlp:
        return Mlp(weights, prefix, config.hidden_act)

    def __call__(self, x: torch.Tensor, rotary: VisionRotary, cos: torch.Tensor,
                 sin: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
        num_patches = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(num_patches, 3, self.num_heads, -1).unbind(1)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        x = x + self.proj(segment_attention(q, k, v, cu_seqlens, self.scale))
        return x + self.mlp(self.norm2(x))


class PatchMerger:
    """norm, then every m x m block of patches (adjacent rows) as one row -> MLP (GELU)."""

    def __init__(self, config: QwenVisionConfig, weights: VisionWeights, prefix: str,
                 norm_cls: type[LayerNorm | RMSNorm]):
        self.norm = norm_cls(weights, prefix + "ln_q", NORM_EPS)
        self.fc1 = linear(weights, prefix + "mlp.0")
        self.fc2 = linear(weights, prefix + "mlp.2")
        self.merged_dim = config.embed_dim * config.spatial_merge_size ** 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).view(-1, self.merged_dim))))


class Qwen2VLVisionEncoder:
    block_cls: type[QwenVisionBlock] = QwenVisionBlock

    def __init__(self, config: QwenVisionConfig, weights: VisionWeights):
        self.config = config
        self.dtype = weights.dtype
        self.device = weights.device
        patch_weight = weights.get(PREFIX + "patch_embed.proj.weight")   # [E, C, T, P, P]
        self.patch_embed = Linear(patch_weight.reshape(config.embed_dim, -1))
        self.rotary = VisionRotary(config.head_dim, config.rope_theta, weights.device)
        self.blocks = [self.block_cls(config, weights, f"{PREFIX}blocks.{i}.")
                       for i in range(config.depth)]
        self.merger = PatchMerger(config, weights, PREFIX + "merger.", self.block_cls.norm_cls)

    def _check_patches(self, pixel_values: torch.Tensor) -> None:
        """Pixels from another model's processor would embed into noise: refuse them."""
        c = self.config
        width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
        if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
            raise ValueError(f"pixel_values must be [num_patches, {width}] (channels x "
                             f"temporal patch x patch^2), got {list(pixel_values.shape)}")

    def encode(self, pixel_values: torch.Tensor,
               image_grid_thw: torch.Tensor | Sequence[Grid]) -> list[torch.Tensor]:
        """Embeddings [num_image_tokens, out_hidden_size] of each image, for the processor's
        pixel_values [num_patches, C * T * P * P] and image_grid_thw [num_images, 3]."""
        grids = [tuple(int(n) for n in g) for g in
                 (image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor)
                  else image_grid_thw)]
        self._check_patches(pixel_values)
        x = self.patch_embed(pixel_values.to(device=self.device, dtype=self.dtype))
        cos, sin = self.rotary.lookup(patch_positions(grids, self.config.spatial_merge_size))
        order, block_cu_seqlens = self._attention_segments(grids)
        if order is not None:
            x, cos, sin = (self._by_merge_block(t, order) for t in (x, cos, sin))
        for block, cu_seqlens in zip(self.blocks, block_cu_seqlens, strict=True):
            x = block(x, self.rotary, cos, sin, cu_seqlens)
        merged = self.merger(x)
        assert merged.shape[-1] == self.config.out_hidden_size, "merger width != text width"
        if order is not None:
            merged = merged[torch.argsort(order.to(merged.device))]
        sizes = [num_image_tokens(g, self.config.spatial_merge_size) for g in grids]
        return list(merged.split(sizes))

    def _attention_segments(
            self, grids: Sequence[Grid]) -> tuple[torch.Tensor | None, list[list[int]]]:
        """The order of merge blocks the blocks run in (None: the processor's) and each
        block's attention segments: here every block attends within each image."""
        return None, [image_cu_seqlens(grids)] * len(self.blocks)

    def _by_merge_block(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """x's rows regrouped as `order` lists its merge blocks (m^2 adjacent rows each)."""
        unit = self.config.spatial_merge_size ** 2
        return x.reshape(-1, unit, *x.shape[1:])[order.to(x.device)].reshape(x.shape)
