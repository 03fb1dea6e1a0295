"""Reads the tensors of an HF checkpoint directory (one or more .safetensors files) by name."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.models.checkpoint_quant import CheckpointQuant, read_checkpoint_quant


class WeightSource:
    """Tensors by name, read lazily (memory-mapped) and converted to the model dtype on demand.

    Names are taken without the "model." prefix HF's *ForCausalLM checkpoints add, so
    "model.layers.0.mlp.up_proj.weight" and "layers.0.mlp.up_proj.weight" both read as the latter;
    a vision-language checkpoint's text model reads the same without its own prefix
    ("model.text_model." for Idefics3, "model.language_model." for Qwen2-VL since transformers
    4.52), while its vision tower keeps its names ("visual.*", "vision_model.*").
    In a checkpoint stored quantized (config.json's quantization_config: `quantization`), a
    linear's weight reads dequantized like any other; get_stored reads the stored tensors.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
        self.model_dir = model_dir
        self.dtype = dtype
        self.device = device
        self.quantization: CheckpointQuant | None = read_checkpoint_quant(model_dir)
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._name_to_handle = {}
        for handle in self._handles:
            for name in handle.keys():
                self._name_to_handle[_text_model_name(name)] = (handle, name)

    def __contains__(self, name: str) -> bool:
        return self.has_stored(name) or self._is_quantized(name)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The named tensor in `dtype` (default: the model's)."""
        if self._is_quantized(name):
            tensor = self.quantization.dequantize(self, name)
        else:
            tensor = self._read(name)
        converted = tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()
        if converted.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            # NOTE: read as stored, it is a view of the file's whole mapping, which one kept
            # norm weight would keep mapped (in the RSS: 538 MB for SmolLM2) for good; and
            # behind sleep mode's level-1 copy (a memfd), that memory cannot be reclaimed.
            return converted.clone()
        return converted

    def get_fused(self, names: list[str], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensors concatenated along dim 0: q/k/v into one qkv weight, gate/up into one."""
        return torch.cat([self.get(name, dtype) for name in names], dim=0)

    def renamed(self, prefix: str, stored_prefix: str) -> WeightSource:
        """A view of the same files reading `prefix`* as `stored_prefix`*: a module stored
        apart (an MTP layer under "mtp_layers.0.") loads by the names of the layer it is."""
        view = copy.copy(self)
        view._name_to_handle = {**self._name_to_handle, **{
            prefix + name.removeprefix(stored_prefix): stored
            for name, stored in self._name_to_handle.items() if name.startswith(stored_prefix)}}
        return view

    def has_stored(self, name: str) -> bool:
        return name in self._name_to_handle

    def get_stored(self, name: str) -> torch.Tensor:
        """The named tensor as the checkpoint stores it (its dtype), on the device."""
        return self._read(name).to(device=self.device)

    def _read(self, name: str) -> torch.Tensor:
        try:
            handle, stored_name = self._name_to_handle[name]
        except KeyError:
            raise KeyError(f"weight {name!r} missing from the checkpoint") from None
        return handle.get_tensor(stored_name)

    def _is_quantized(self, name: str) -> bool:
        return self.quantization is not None and self.quantization.is_quantized(self, name)


_TEXT_MODEL_PREFIXES = ("language_model.", "text_model.")


def _text_model_name(name: str) -> str:
    name = name.removeprefix("model.")
    for prefix in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name
