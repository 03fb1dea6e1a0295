"""The tensors of a vision tower, read by name from an HF checkpoint or an in-memory state dict."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.worker.models.weights import WeightSource


class VisionWeights:
    """Tensors by name ("visual.blocks.0.attn.qkv.weight"), in the tower's dtype and device.

    NOTE: transformers moved the towers under the base model ("model.visual.*" since 4.52,
    "visual.*" before; Idefics3 has always used "model.vision_model.*"), so names are taken
    without a leading "model.": both spellings read the same. A WeightSource strips it already.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | WeightSource, dtype: torch.dtype,
                 device: torch.device):
        self.dtype = dtype
        self.device = device
        self._source = tensors if isinstance(tensors, WeightSource) else None
        self._tensors: dict[str, torch.Tensor] = {}
        if self._source is None:
            self._tensors = {name.removeprefix("model."): t for name, t in tensors.items()}

    def __contains__(self, name: str) -> bool:
        if self._source is not None:
            return name in self._source
        return name in self._tensors

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The named tensor in `dtype` (default: the tower's), contiguous, on the device."""
        if self._source is not None:
            return self._source.get(name, dtype or self.dtype).to(self.device)
        try:
            tensor = self._tensors[name]
        except KeyError:
            raise KeyError(f"weight {name!r} missing from the checkpoint") from None
        return tensor.detach().to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def get_optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None
