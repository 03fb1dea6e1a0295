"""Reads the tensors of an HF checkpoint directory (one or more .safetensors files) by name."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


class WeightSource:
    """Tensors by name, read lazily (memory-mapped) and converted to the model dtype on demand.

    Names are taken without the "model." prefix HF's *ForCausalLM checkpoints add, so
    "model.layers.0.mlp.up_proj.weight" and "layers.0.mlp.up_proj.weight" both read as the latter.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
        self.dtype = dtype
        self.device = device
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._name_to_handle = {}
        for handle in self._handles:
            for name in handle.keys():
                self._name_to_handle[name.removeprefix("model.")] = (handle, name)

    def __contains__(self, name: str) -> bool:
        return name in self._name_to_handle

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The named tensor in `dtype` (default: the model's)."""
        try:
            handle, stored_name = self._name_to_handle[name]
        except KeyError:
            raise KeyError(f"weight {name!r} missing from the checkpoint") from None
        tensor = handle.get_tensor(stored_name)
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def get_fused(self, names: list[str], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensors concatenated along dim 0: q/k/v into one qkv weight, gate/up into one."""
        return torch.cat([self.get(name, dtype) for name in names], dim=0)
