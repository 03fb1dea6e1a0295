"""The small steps vision towers share: norms, activations, an MLP, attention within segments.

Plain objects holding tensors, as the text models' layers are (layers.py): a tower runs once
per image, so the point is not dispatch cost but one shape for every model file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from services.worker.models.config import UnsupportedModelError
from services.worker.models.layers import Linear
from services.worker.models.vision.vision_weights import VisionWeights


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF `hidden_act` names -> the function (transformers' ACT2FN, for the ones towers use).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(f"vision activation {name!r} is not supported") from None


def linear(weights: VisionWeights, prefix: str) -> Linear:
    """The linear `prefix`.weight (+ `prefix`.bias where the checkpoint has one)."""
    return Linear(weights.get(prefix + ".weight"), weights.get_optional(prefix + ".bias"))


class LayerNorm:
    def __init__(self, weights: VisionWeights, prefix: str, eps: float):
        self.weight = weights.get(prefix + ".weight")
        self.bias = weights.get_optional(prefix + ".bias")
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm:
    def __init__(self, weights: VisionWeights, prefix: str, eps: float):
        self.weight = weights.get(prefix + ".weight")
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalized in fp32 and cast before the scale, as HF's RMSNorm rounds.
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return self.weight * normed


class Mlp:
    """fc2(act(fc1(x))): the towers' plain MLP (ViT / SigLIP, Qwen2-VL)."""

    def __init__(self, weights: VisionWeights, prefix: str, hidden_act: str):
        self.fc1 = linear(weights, prefix + ".fc1")
        self.fc2 = linear(weights, prefix + ".fc2")
        self.act = activation(hidden_act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: Sequence[int], scale: float) -> torch.Tensor:
    """Bidirectional attention of q, k, v [num_patches, num_heads, head_dim] within each
    segment [cu_seqlens[i], cu_seqlens[i + 1]) (an image, or a window of one): [num_patches,
    num_heads * head_dim].

    NOTE: one SDPA call per segment, what HF's sdpa path does: no mask of num_patches^2 is
    built. A varlen flash kernel on GPU would take cu_seqlens as they are.
    """
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if start == end:
            continue
        seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]   # [H, n, D]
        out[start:end] = F.scaled_dot_product_attention(*seg, scale=scale).transpose(0, 1)
    return out.flatten(1)
