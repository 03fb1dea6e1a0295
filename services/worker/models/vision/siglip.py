"""The SigLIP vision transformer as Idefics3 / SmolVLM run it (NaViT-style "patch n' pack").

Images of one size (the processor pads each batch to it; pixel_attention_mask marks the real
pixels) -> Conv2d patch embed + a learned position embedding -> pre-norm encoder layers ->
LayerNorm. A padded image's real patches are spread over the whole position table: each patch's
fractional (row, column) within the real part is bucketed into the table's grid, so a small
image reads the same spread of positions as a full one. Padding patches keep position 0 and
are masked out as attention keys (their own outputs are computed and kept, as in HF).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.models.layers import Linear
from services.worker.models.vision.vision_layers import LayerNorm, Mlp, linear
from services.worker.models.vision.vision_weights import VisionWeights


@dataclass(frozen=True)
class SiglipVisionConfig:
    """HF's Idefics3VisionConfig fields (its defaults where config.json leaves one out)."""
    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    # The input: square images of image_size pixels (the position table's extent).
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> SiglipVisionConfig:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in vision.items() if k in fields})

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def patch_position_ids(patch_mask: torch.Tensor, num_patches_per_side: int) -> torch.Tensor:
    """Position-table index [N, h * w] of each patch of images whose real patches are
    patch_mask [N, h, w] (a top-left rectangle), 0 for padding patches.

    NOTE: the same float steps as HF (boundaries by arange of 1 / side, coordinates as index
    times 1 / real size, clamped below 1): a patch on a bucket boundary lands where HF's does.
    """
    side = num_patches_per_side
    device = patch_mask.device
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
    step_h = 1.0 / patch_mask[:, :, 0].sum(dim=1)          # [N]: 1 / real rows
    step_w = 1.0 / patch_mask[:, 0, :].sum(dim=1)
    rows = torch.arange(patch_mask.shape[1], device=device, dtype=torch.float32)
    cols = torch.arange(patch_mask.shape[2], device=device, dtype=torch.float32)
    frac_h = torch.clamp(rows[None, :] * step_h[:, None], max=1.0 - 1e-6)
    frac_w = torch.clamp(cols[None, :] * step_w[:, None], max=1.0 - 1e-6)
    bucket_h = torch.bucketize(frac_h, boundaries, right=True)
    bucket_w = torch.bucketize(frac_w, boundaries, right=True)
    ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).flatten(1)
    return torch.where(patch_mask.flatten(1), ids, torch.zeros_like(ids))


class SiglipEncoderLayer:
    def __init__(self, config: SiglipVisionConfig, weights: VisionWeights, prefix: str):
        attn = prefix + "self_attn."
        names = [f"{attn}{p}_proj" for p in "qkv"]
        self.qkv = Linear(torch.cat([weights.get(n + ".weight") for n in names]),
                          torch.cat([weights.get(n + ".bias") for n in names]))
        self.out_proj = linear(weights, attn + "out_proj")
        self.layer_norm1 = LayerNorm(weights, prefix + "layer_norm1", config.layer_norm_eps)
        self.layer_norm2 = LayerNorm(weights, prefix + "layer_norm2", config.layer_norm_eps)
        self.mlp = Mlp(weights, prefix + "mlp", config.hidden_act)
        self.num_heads = config.num_attention_heads
        self.scale = (config.hidden_size // config.num_attention_heads) ** -0.5

    def __call__(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [N, S, E]; key_mask [N, 1, 1, S] (True: a real patch) or None (all real)."""
        n, s, _ = x.shape
        qkv = self.qkv(self.layer_norm1(x).flatten(0, 1)).view(n, s, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)      # [N, H, S, D] each
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.scale)
        x = x + self.out_proj(attn.transpose(1, 2).flatten(0, 1).flatten(1)).view(n, s, -1)
        return x + self.mlp(self.layer_norm2(x).flatten(0, 1)).view(n, s, -1)


class SiglipVisionTransformer:
    def __init__(self, config: SiglipVisionConfig, weights: VisionWeights, prefix: str):
        self.config = config
        self.patch_weight = weights.get(prefix + "embeddings.patch_embedding.weight")
        self.patch_bias = weights.get(prefix + "embeddings.patch_embedding.bias")
        self.position_embedding = weights.get(prefix + "embeddings.position_embedding.weight")
        self.layers = [SiglipEncoderLayer(config, weights, f"{prefix}encoder.layers.{i}.")
                       for i in range(config.num_hidden_layers)]
        self.post_layernorm = LayerNorm(weights, prefix + "post_layernorm",
                                        config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor,
                patch_mask: torch.Tensor | None) -> torch.Tensor:
        """Hidden states [N, num_patches, hidden] of images [N, C, H, W] whose real patches
        are patch_mask [N, H / patch, W / patch] (None: every patch)."""
        p = self.config.patch_size
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.config.num_channels:
            raise ValueError(f"pixel_values must be [N, {self.config.num_channels}, H, W], "
                             f"got {list(pixel_values.shape)}")
        pixel_values = pixel_values.to(self.patch_weight.dtype)
        x = F.conv2d(pixel_values, self.patch_weight, self.patch_bias, stride=p)
        x = x.flatten(2).transpose(1, 2)                      # [N, patches, E], row-major
        if patch_mask is None:
            n, _, h, w = pixel_values.shape
            patch_mask = torch.ones(n, h // p, w // p, dtype=torch.bool, device=x.device)
        x = x + F.embedding(patch_position_ids(patch_mask, self.config.num_patches_per_side),
                            self.position_embedding)
        key_mask = None if bool(patch_mask.all()) else patch_mask.flatten(1)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)
