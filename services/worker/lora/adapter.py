"""LoRA adapters in PEFT format, read into the layout of the model's fused linears.

A PEFT adapter directory holds adapter_config.json (`r`, `lora_alpha`, `target_modules`,
`use_rslora`) and adapter_model.safetensors with lora_A [r, in] and lora_B [out, r] per
targeted projection. The model fuses q/k/v into qkv_proj and gate/up into gate_up_proj, so an
adapter's pair for a fused linear is its parts' A stacked (the parts it targets, in output
order) and their B placed block-diagonally: x A^T holds each part's r columns side by side and
B maps each block back onto that part's output rows only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# NOTE: the module path's last two names (layers.{i}.{block}.{proj}) are all the match needs:
# PEFT prefixes them with base_model.model.model. or similar, depending on the task type.
_WEIGHT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json options that ask for something these adapters cannot do when set
# (true, non-empty); and `bias` other than "none".
_UNSUPPORTED_OPTIONS = ("use_dora", "use_qalora", "use_bdlora", "fan_in_fan_out", "lora_bias",
                        "modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters",
                        "layer_replication", "trainable_token_indices",
                        "alora_invocation_tokens")


class LoraError(ValueError):
    """An adapter this worker cannot serve (bad files, too big, made for another model), or
    a step asking for adapters it does not have room for."""


@dataclass(frozen=True)
class LoraTarget:
    """One of the model's linears an adapter may change: its input width and the checkpoint
    projections fused in it with their output widths, in output order."""
    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.parts)


@dataclass(frozen=True)
class LoraWeights:
    """One fused linear's low-rank pair: y += scaling * (x lora_a^T) lora_b^T."""
    lora_a: torch.Tensor   # [rank, in_features]
    lora_b: torch.Tensor   # [out_features, rank]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    scaling: float
    weights: dict[tuple[int, str], LoraWeights]   # (layer index, fused linear name) -> pair


def load_peft_adapter(path: Path, layer_targets: list[dict[str, LoraTarget]], max_rank: int,
                      dtype: torch.dtype) -> LoraAdapter:
    """Reads and checks a PEFT adapter against the model's linears (`layer_targets[i]`:
    layer i's linears by name); raises LoraError when it does not fit."""
    config = _read_config(path)
    rank = int(config["r"])
    if rank > max_rank:
        raise LoraError(f"adapter {path.name} has rank {rank}, over --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _read_pairs(path, layer_targets, rank)
    weights = {}
    for layer, targets in enumerate(layer_targets):
        for name, target in targets.items():
            present = [(part, pairs[layer, part]) for part, _ in target.parts
                       if (layer, part) in pairs]
            if present:
                weights[layer, name] = _fuse(target, dict(present), rank, dtype)
    return LoraAdapter(scaling, weights)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"no readable adapter_config.json in {path}: {e}") from None
    if config.get("peft_type", "LORA") != "LORA" or "r" not in config:
        raise LoraError(f"{path.name} is not a LoRA adapter (peft_type "
                        f"{config.get('peft_type')!r})")
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise LoraError(f"adapter {path.name}: {option}={config[option]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {path.name}: bias={config['bias']!r} is not supported")
    return config


def _read_pairs(path: Path, layer_targets: list[dict[str, LoraTarget]],
                rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) -> (A, B), shapes checked against the model."""
    part_shapes = [{part: (target.in_features, size) for target in targets.values()
                    for part, size in target.parts} for targets in layer_targets]
    try:
        tensors = load_file(path / "adapter_model.safetensors")
    except OSError as e:
        raise LoraError(f"no readable adapter_model.safetensors in {path}: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.fullmatch(key)
        if match is None:
            raise LoraError(f"adapter {path.name} targets {key}: only the attention and MLP "
                            f"projections of the decoder layers take LoRA")
        layer, part, half = int(match[1]), match[2], match[3]
        if layer >= len(layer_targets) or part not in part_shapes[layer]:
            known = sorted(part_shapes[0]) if part_shapes else []
            raise LoraError(f"adapter {path.name} targets {key}: unknown target module for "
                            f"this model (layers 0-{len(layer_targets) - 1}, modules {known})")
        in_features, out_features = part_shapes[layer][part]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise LoraError(f"adapter {path.name} was made for another base model or rank: "
                            f"{key} is {list(tensor.shape)}, this model's {part} (input "
                            f"{in_features}, output {out_features}) at rank {rank} needs "
                            f"{list(want)}")
        halves.setdefault((layer, part), {})[half] = tensor
    missing = [f"layers.{layer}.{part}" for (layer, part), h in halves.items() if len(h) < 2]
    if missing:
        raise LoraError(f"adapter {path.name} lacks lora_A or lora_B for {missing}")
    return {key: (h["A"], h["B"]) for key, h in halves.items()}


def _fuse(target: LoraTarget, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int,
          dtype: torch.dtype) -> LoraWeights:
    """Stacked A of the parts present, B block-diagonal over the fused output rows."""
    lora_a = torch.cat([pairs[part][0] for part, _ in target.parts if part in pairs])
    lora_b = torch.zeros(target.out_features, lora_a.shape[0])
    row = col = 0
    for part, size in target.parts:
        if part in pairs:
            lora_b[row:row + size, col:col + rank] = pairs[part][1]
            col += rank
        row += size
    return LoraWeights(lora_a.to(dtype), lora_b.to(dtype))
