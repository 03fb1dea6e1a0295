"""Turns a loaded model into one that serves LoRA adapters: enable_lora wraps each decoder
layer's projections (qkv_proj, o_proj, gate_up_proj, down_proj) in a LoraLinear and returns
the LoraManager that loads adapters into them and maps each step's rows to their slots."""

from __future__ import annotations

from services.worker.lora.adapter import LoraError, LoraTarget
from services.worker.lora.lora_linear import LoraLinear, LoraMapping
from services.worker.lora.lora_manager import LoraManager
from services.worker.models.config import ModelConfig
from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def enable_lora(model: LlamaForCausalLM, max_loras: int, max_rank: int,
                max_cpu_loras: int | None = None) -> LoraManager:
    """Wraps the model's linears in place. max_cpu_loras defaults to max_loras."""
    if not isinstance(model, LlamaForCausalLM):
        raise LoraError(f"LoRA is not supported on {type(model).__name__} (tensor "
                        f"parallelism, for one)")
    layer_targets = [_layer_targets(layer, model.config) for layer in model.layers]
    dtype, device = model.embed_tokens.dtype, model.embed_tokens.device
    mapping = LoraMapping()
    linears = {}
    for index, (layer, targets) in enumerate(zip(model.layers, layer_targets)):
        for name, target in targets.items():
            linear = LoraLinear(getattr(layer, name), target.in_features, target.out_features,
                                max_loras, max_rank * len(target.parts), mapping, dtype,
                                device)
            setattr(layer, name, linear)
            linears[index, name] = linear
    return LoraManager(linears, layer_targets, mapping, max_loras, max_rank,
                       max_cpu_loras or max_loras, dtype, device)


def _layer_targets(layer: LlamaDecoderLayer, config: ModelConfig) -> dict[str, LoraTarget]:
    """The layer's linears with the checkpoint projections fused in each, in output order.
    NOTE: a mixture-of-experts layer has no dense gate_up_proj / down_proj: only its
    attention takes LoRA."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    qkv = (q_size, kv_size, kv_size) if len(layer.qkv_proj_names) == 3 else (q_size + 2 * kv_size,)
    targets = {"qkv_proj": LoraTarget(hidden, tuple(zip(layer.qkv_proj_names, qkv))),
               "o_proj": LoraTarget(q_size, (("o_proj", hidden),))}
    if hasattr(layer, "gate_up_proj"):
        names = layer.gate_up_proj_names
        targets["gate_up_proj"] = LoraTarget(
            hidden, tuple((name, 2 * intermediate // len(names)) for name in names))
        targets["down_proj"] = LoraTarget(intermediate, (("down_proj", hidden),))
    return targets
