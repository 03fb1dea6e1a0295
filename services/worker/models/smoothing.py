"""SmoothQuant for --quantization int8: moves the activations' outlier channels into the weights
before both are quantized.

Per-token int8 activations are coarse where a few channels run 10-25x a row's RMS: the row's
one scale is set by them and every other channel keeps a few levels. For each group of linears
fed by one input (q/k/v after input_layernorm; gate/up after post_attention_layernorm; down
after act(gate) * up), per input channel j:

    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)

the input is divided by s (folded into the RMSNorm's weight, or into up_proj's rows for
down_proj: the product act(gate) * up is linear in up) and the weights' columns multiplied by
it. In exact arithmetic the model is unchanged (tests/worker/test_int8.py checks it in fp32);
the int8 steps see flatter activations. o_proj is left alone: its input channels belong to V's
heads, shared by several query heads (GQA), so one s per channel cannot be folded into V.

max|x_j| comes from HF transformers' fp32 forward over CALIBRATION_TEXT at load (the embedded
model: ~2 s once per start). Where it applies: model_loader.uses_int8_smoothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import structlog
import torch

from services.worker.models.weights import WeightSource

log = structlog.get_logger(__name__)

# SmoothQuant's strength: 0 leaves the activations as they are, 1 moves all their range into
# the weights. Measured on the embedded model (docs/benchmarks.md 10c): 0.8 beat 0.5.
ALPHA = 0.8

# Plain prose, instructions, code and Q&A, none of it the perplexity text of benchmarks/int8.py.
CALIBRATION_TEXT = """\
The river had been rising for three days before anyone in the village thought to move the \
grain. By the time the elders met in the hall, water stood ankle deep in the lower fields and \
the miller had already tied his boat to the porch. They argued about whether the old levee \
would hold, and in the end they agreed to do nothing until morning.

To install the package, run the setup script from the project root and then restart the \
service. If the service fails to start, check the log file for errors about missing \
permissions or ports that are already in use. Most problems come from an old configuration \
file left behind by a previous version.

def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i]); i += 1
        else:
            result.append(b[j]); j += 1
    return result + a[i:] + b[j:]

Photosynthesis converts light energy into chemical energy stored in glucose. Plants take in \
carbon dioxide through small openings in their leaves and release oxygen as a by-product.

Q: What is the capital of Australia? A: Canberra. Q: How many legs does a spider have? \
A: Eight. Q: Who wrote the novel about a white whale? A: Herman Melville.
"""
CALIBRATION_CHAT = "Explain how a bicycle stays upright."

# The linear whose input each group's activations are read at, in HF's module names.
_PROBES = {"self_attn.q_proj": "attn", "mlp.gate_proj": "mlp", "mlp.down_proj": "down"}
_PROBE_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(" + "|".join(map(re.escape, _PROBES)) + ")")


def calibrate(model_dir: Path) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, group) -> max |x_j| over the calibration tokens, per input channel (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"--quantization int8 calibrates its SmoothQuant scales with HF "
                           f"transformers, which cannot load {model_dir}: {exc}") from exc
    maxima: dict[tuple[int, str], torch.Tensor] = {}

    def record(key: tuple[int, str]):
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            maxima[key] = torch.maximum(maxima[key], x) if key in maxima else x
        return hook

    for name, module in model.named_modules():
        match = _PROBE_NAME.fullmatch(name)
        if match is not None:
            module.register_forward_pre_hook(record((int(match[1]), _PROBES[match[2]])))
    inputs = [tokenizer(CALIBRATION_TEXT, return_tensors="pt")["input_ids"]]
    if tokenizer.chat_template:
        inputs.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": CALIBRATION_CHAT}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True)["input_ids"])
    with torch.inference_mode():
        for input_ids in inputs:
            model(input_ids)
    return maxima


class SmoothedWeights(WeightSource):
    """The checkpoint's tensors with SmoothQuant's scales folded in (read through get, so
    get_fused and every model class see them)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 num_layers: int):
        super().__init__(model_dir, dtype, device)
        maxima = calibrate(model_dir)
        # name -> factors its fp32 values are multiplied by, each broadcast over the tensor.
        self._factors: dict[str, list[torch.Tensor]] = {}
        for i in range(num_layers):
            attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            s_attn = self._scales(maxima[i, "attn"],
                                  [attn + p for p in ("q_proj", "k_proj", "v_proj")])
            s_mlp = self._scales(maxima[i, "mlp"], [mlp + "gate_proj", mlp + "up_proj"])
            s_down = self._scales(maxima[i, "down"], [mlp + "down_proj"])
            for name in ("q_proj", "k_proj", "v_proj"):
                self._fold(attn + name + ".weight", s_attn[None, :])
            self._fold(f"layers.{i}.input_layernorm.weight", 1 / s_attn)
            self._fold(mlp + "gate_proj.weight", s_mlp[None, :])
            self._fold(mlp + "up_proj.weight", s_mlp[None, :], 1 / s_down[:, None])
            self._fold(f"layers.{i}.post_attention_layernorm.weight", 1 / s_mlp)
            self._fold(mlp + "down_proj.weight", s_down[None, :])

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        factors = self._factors.get(name)
        if factors is None:
            return super().get(name, dtype)
        tensor = super().get(name, torch.float32)
        for factor in factors:
            tensor = tensor * factor.to(tensor.device)
        return tensor.to(dtype or self.dtype).contiguous()

    def _scales(self, x_max: torch.Tensor, weight_names: list[str]) -> torch.Tensor:
        # NOTE: the checkpoint's own values (WeightSource.get), not yet smoothed.
        w_max = torch.stack([WeightSource.get(self, n + ".weight", torch.float32).abs()
                             .amax(dim=0).cpu() for n in weight_names]).amax(dim=0)
        # NOTE: a channel that never fired (or an all-zero column) keeps s = 1.
        scales = x_max.clamp(min=1e-5).pow(ALPHA) / w_max.clamp(min=1e-5).pow(1 - ALPHA)
        return torch.where((x_max > 0) & (w_max > 0), scales, torch.ones_like(scales))

    def _fold(self, name: str, *factors: torch.Tensor) -> None:
        self._factors[name] = list(factors)

