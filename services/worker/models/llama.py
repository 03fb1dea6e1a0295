"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) over a flattened varlen batch.

One forward pass runs every scheduled token of every request as a single [num_tokens, hidden]
batch: no padding to the longest request, no per-request Python loop. q/k/v are one fused
matmul, gate/up another; rope's cos/sin and the attention metadata are looked up once per step
and shared by all layers. Qwen2 adds a q/k/v bias, Qwen3 an RMSNorm over each head of q and k.
Each layer hands the attention backend its AttentionLayer (scale, sliding window, soft-cap), so
a model may mix sliding-window and global layers. Other families subclass these (gemma.py).

NOTE: runs eagerly. torch.compile (inductor, dynamic shapes, attention left eager) was measured
on the 2-core CPU: slower in the model (+8% step time at batch 1, +4% at 32) and in isolated
blocks, with ~7 s of compile at start-up, so it is not used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend, AttentionLayer, KVCache
from services.worker.models.checkpoint_quant.scheme import LinearLike
from services.worker.models.config import ModelConfig
from services.worker.models.int8 import Int8Linear
from services.worker.models.layer_ops import TorchLayerOps, layer_ops_for
from services.worker.models.layers import Linear
from services.worker.models.quantized import BlockSource
from services.worker.models.rotary import RotaryEmbedding
from services.worker.models.vision.mrope import MRotaryEmbedding
from services.worker.models.weights import WeightSource
from services.worker.runner.cpu_runtime import load_cpu_kernels

LinearFactory = Callable[..., Linear | Int8Linear]   # (weight names, bias=None) -> a linear


class LlamaDecoderLayer:
    # The checkpoint's projections that make up the fused qkv and gate_up linears.
    qkv_proj_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up_proj_names: tuple[str, ...] = ("gate_proj", "up_proj")

    def __init__(self, config: ModelConfig, weights: WeightSource, index: int,
                 attn: AttentionBackend, rotary: RotaryEmbedding, ops: TorchLayerOps,
                 linear: LinearFactory):
        prefix = f"layers.{index}."
        attn_prefix = prefix + "self_attn."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = weights.get_fused([f"{attn_prefix}{p}.bias" for p in self.qkv_proj_names])
        self.qkv_proj = linear([f"{attn_prefix}{p}.weight" for p in self.qkv_proj_names],
                               qkv_bias)
        self.o_proj = linear([attn_prefix + "o_proj.weight"])
        self.input_layernorm = self._norm_weight(weights, prefix + "input_layernorm.weight")
        self.post_attention_layernorm = self._norm_weight(
            weights, prefix + "post_attention_layernorm.weight")
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = self._norm_weight(weights, attn_prefix + "q_norm.weight")
            self.k_norm = self._norm_weight(weights, attn_prefix + "k_norm.weight")
        self.act_and_mul = ops.act_and_mul(config.hidden_act)
        self.silu_mlp = config.hidden_act == "silu"
        self.attn_layer = AttentionLayer(config.scale, config.layer_sliding_windows[index],
                                         config.attn_logit_softcapping)
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.attn = attn
        self.rotary = rotary
        self.ops = ops
        self.kv_cache: KVCache | None = None
        self._load_mlp(config, weights, index, linear)

    @staticmethod
    def _norm_weight(weights: WeightSource, name: str) -> torch.Tensor:
        """An RMSNorm's scale as the model multiplies by it (Gemma stores it minus one)."""
        return weights.get(name)

    def _load_mlp(self, config: ModelConfig, weights: WeightSource, index: int,
                  linear: LinearFactory) -> None:
        mlp_prefix = f"layers.{index}.mlp."
        self.gate_up_proj = linear([f"{mlp_prefix}{p}.weight" for p in self.gate_up_proj_names])
        self.down_proj = linear([mlp_prefix + "down_proj.weight"])

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    @property
    def num_bytes(self) -> int:
        norms = [self.input_layernorm, self.post_attention_layernorm, self.q_norm, self.k_norm]
        return (sum(t.numel() * t.element_size() for t in norms if t is not None)
                + sum(lin.num_bytes for lin in self.linears))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: the residual stream is summed in place into the freshly produced tensors.
        hidden, residual = self.ops.add_rms_norm(hidden, residual, self.input_layernorm,
                                                 self.eps)
        hidden = self._attention(hidden, cos, sin, attn_metadata)
        hidden, residual = self.ops.add_rms_norm(hidden, residual,
                                                 self.post_attention_layernorm, self.eps)
        return self._mlp(hidden), residual

    def _attention(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attn_metadata: Any) -> torch.Tensor:
        q, k, v = self._qkv(self.qkv_proj(hidden), cos, sin)
        return self.o_proj(self.attn.forward(q, k, v, self.kv_cache, attn_metadata,
                                             self.attn_layer))

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.silu_mlp and isinstance(gate_up, Linear) and gate_up.fuses_silu_and_mul:
            return self.down_proj(gate_up.silu_and_mul(hidden))
        return self.down_proj(self.act_and_mul(gate_up(hidden)))

    def _qkv(self, qkv: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] with rope applied, v [T, Hkv, D] (a view of qkv)."""
        num_tokens, num_qk_heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk_size = num_qk_heads * self.head_dim
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        qk = qkv[:, :qk_size].view(num_tokens, num_qk_heads, self.head_dim)
        if self.q_norm is None:
            # NOTE: q and k sit side by side in the qkv output: one rope call rotates both.
            qk = self.rotary.apply(qk, cos, sin)
            return qk[:, :self.num_heads], qk[:, self.num_heads:], v
        q = self.ops.rms_norm(qk[:, :self.num_heads], self.q_norm, self.eps)
        k = self.ops.rms_norm(qk[:, self.num_heads:], self.k_norm, self.eps)
        return self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin), v


class LlamaForCausalLM:
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, weights: WeightSource, attn: AttentionBackend,
                 max_position: int, blocks: BlockSource | None = None,
                 quantization: str = "none"):
        """`blocks`: the GGUF blocks of the weights, read by small batches (quantized.py);
        quantization "int8": every linear is an Int8Linear (int8.py)."""
        self.config = config
        # NOTE: the layers' small steps (norms, SiLU-and-mul, rope) run as one kernel each: Triton
        # on CUDA, C++ on CPU where those could be built (kernels/cpu_ops.py), torch otherwise.
        kernels = load_cpu_kernels() if weights.device.type == "cpu" else None
        self.ops = layer_ops_for(weights.device, kernels)
        rotary_kernels = self.ops.rotary_kernels
        # Qwen2-VL: M-RoPE over positions [3, T] (vision/mrope.py); on CUDA its rope stays torch.
        self.rotary = (RotaryEmbedding(config.head_dim, max_position, config.rope_theta,
                                       config.rope_scaling, weights.dtype, weights.device,
                                       rotary_kernels)
                       if config.mrope_section is None else
                       MRotaryEmbedding(config.head_dim, max_position, config.rope_theta,
                                        config.mrope_section, weights.dtype, weights.device,
                                        kernels))

        def linear(names: list[str], bias: torch.Tensor | None = None,
                   weight: torch.Tensor | None = None) -> Linear | Int8Linear | LinearLike:
            # A checkpoint stored quantized runs its stored form where this device can;
            # elsewhere weights.get_fused reads its weights dequantized (checkpoint_quant/).
            if weights.quantization is not None and weight is None:
                stored = weights.quantization.linear(weights, names, bias, kernels,
                                                     quantization)
                if stored is not None:
                    return stored
            if quantization == "int8":   # from the fp32 values, whatever the model dtype
                return Int8Linear(weights.get_fused(names, torch.float32), bias, kernels)
            quantized = blocks.get_fused(names) if blocks is not None else None
            return Linear(weights.get_fused(names) if weight is None else weight, bias,
                          quantized, kernels)

        self.embed_tokens = weights.get("embed_tokens.weight")
        # Token ids -> hidden rows (tensor parallelism swaps in a vocab-parallel lookup).
        self.embedding: Callable[[torch.Tensor], torch.Tensor] = functools.partial(
            F.embedding, weight=self.embed_tokens)
        # Gemma 3: sliding layers rotate with a rope base of their own.
        local_rotary = self.rotary if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, max_position, config.local_rope_theta, None, weights.dtype,
            weights.device, rotary_kernels)
        self.layers = [self.layer_cls(config, weights, i, attn,
                                      self.rotary if window is None else local_rotary,
                                      self.ops, linear)
                       for i, window in enumerate(config.layer_sliding_windows)]
        self.rotaries = list({id(layer.rotary): layer.rotary for layer in self.layers}.values())
        self.norm = self.layer_cls._norm_weight(weights, "norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = (linear(["embed_tokens.weight"], weight=self.embed_tokens) if tied
                        else linear(["lm_head.weight"]))
        self.num_bytes = (self.embed_tokens.numel() * self.embed_tokens.element_size()
                          + sum(layer.num_bytes for layer in self.layers)
                          + self.norm.numel() * self.norm.element_size()
                          + self.lm_head.num_bytes * (not tied))
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        """Set by EAGLE-3 and MTP (spec_decode/eagle_proposer.py): forward keeps the residual
        stream entering these layers (num_hidden_layers: leaving the last one, before the
        final norm), concatenated, in aux_hidden_states [num_tokens, n * hidden]."""
        self.aux_hidden_states: torch.Tensor | None = None
        linears = [lin for layer in self.layers for lin in layer.linears] + [self.lm_head]
        # What a step of a few rows reads: GGUF blocks where the linears have them.
        self.small_batch_bytes = (self.num_bytes - sum(lin.num_bytes for lin in linears)
                                  + sum(lin.num_bytes_per_small_batch for lin in linears))

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None:
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer.kv_cache = kv_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] of the flattened batch. positions:
        [T], or [3, T] with M-RoPE; inputs_embeds (images' embeddings in place) replaces the
        lookup of input_ids."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        # NOTE: cos / sin looked up once per step per rope table, shared by the layers using it.
        tables = {id(rotary): rotary.lookup(positions) for rotary in self.rotaries}
        residual = None
        kept = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                kept.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer.forward(hidden, residual, *tables[id(layer.rotary)],
                                             attn_metadata)
        normed, stream = self.ops.add_rms_norm(hidden, residual, self.norm,
                                               self.config.rms_norm_eps)
        if len(self.layers) in self.aux_hidden_state_layers:
            kept.append(stream)   # the stream leaving the last layer: what MTP reads
        if kept:
            self.aux_hidden_states = torch.cat(kept, dim=-1)
        return normed

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] for the rows that need them (sampling, prompt logprobs)."""
        return self.lm_head(hidden).float()
