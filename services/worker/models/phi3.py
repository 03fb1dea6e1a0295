"""Phi-3: the Llama layer over checkpoints that store q/k/v as one qkv_proj and gate/up as one
gate_up_proj (in the order our fused linears use), with LongRoPE scaling (rotary.py)."""

from __future__ import annotations

from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3DecoderLayer(LlamaDecoderLayer):
    qkv_proj_names = ("qkv_proj",)
    gate_up_proj_names = ("gate_up_proj",)


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls = Phi3DecoderLayer
