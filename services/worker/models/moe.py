"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama layer with a routed MLP.

Per token the router's softmax picks num_experts_per_tok experts (renormalized where the model
does); the fused MoE op (kernels/) runs every token-expert pair grouped by expert: Triton
grouped GEMMs on a GPU, the torch reference grouped by expert elsewhere (on the CPU each
expert is two oneDNN/MKL matmuls over its tokens). Qwen2-MoE adds a shared expert every token
goes through, scaled by sigmoid(shared_expert_gate(x)). Layers the config keeps dense run the
Llama MLP. The checkpoint's per-expert matrices are stacked at load: w13 [E, 2I, H] (gate rows,
then up rows) and w2 [E, H, I].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import kernels
from services.worker.models.config import ModelConfig, MoEConfig, UnsupportedModelError
from services.worker.models.layers import Linear
from services.worker.models.llama import LinearFactory, LlamaDecoderLayer, LlamaForCausalLM
from services.worker.models.weights import WeightSource

FusedMoE = Callable[..., torch.Tensor]   # (hidden, w13, w2, topk_weights, topk_ids) -> out


def fused_moe_for(device: torch.device) -> FusedMoE:
    """The Triton kernel on CUDA, the torch reference grouped by expert elsewhere (kernels/
    resolves names lazily: the CPU path never imports triton)."""
    return kernels.fused_moe if device.type == "cuda" else kernels.ref_fused_moe


class SparseMoeBlock:
    def __init__(self, moe: MoEConfig, weights: WeightSource, prefix: str,
                 expert_names: tuple[str, str, str], linear: LinearFactory,
                 act_and_mul: Callable[[torch.Tensor], torch.Tensor]):
        """prefix: the block's weights ("layers.3.mlp."); expert_names: each expert's gate,
        up and down projections (Mixtral: w1, w3, w2)."""
        gate, up, down = expert_names
        experts = [f"{prefix}experts.{e}." for e in range(moe.num_experts)]
        self.w13 = torch.stack([weights.get_fused([f"{p}{gate}.weight", f"{p}{up}.weight"])
                                for p in experts])
        self.w2 = torch.stack([weights.get(f"{p}{down}.weight") for p in experts])
        self.router = linear([prefix + "gate.weight"])
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.fused_moe = fused_moe_for(weights.device)
        self.act_and_mul = act_and_mul
        self.shared_linears: tuple[Linear, ...] = ()
        if moe.shared_expert_intermediate_size:
            shared = prefix + "shared_expert."
            self.shared_linears = (
                linear([shared + "gate_proj.weight", shared + "up_proj.weight"]),
                linear([shared + "down_proj.weight"]),
                linear([prefix + "shared_expert_gate.weight"]))

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.router, *self.shared_linears)

    @property
    def num_expert_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # NOTE: HF's order and precision: softmax in fp32, top-k, then renormalize.
        probs = self.router(hidden).float().softmax(dim=-1)
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
        out = self.fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids)
        if self.shared_linears:
            gate_up, down, gate = self.shared_linears
            shared = down(self.act_and_mul(gate_up(hidden)))
            out += torch.sigmoid(gate(hidden)) * shared
        return out


class MoEDecoderLayer(LlamaDecoderLayer):
    """A family's names: where its MoE block's weights sit and what its experts call their
    gate, up and down projections."""
    moe_prefix: str = "mlp."
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def _load_mlp(self, config: ModelConfig, weights: WeightSource, index: int,
                  linear: LinearFactory) -> None:
        assert config.moe is not None
        self.moe: SparseMoeBlock | None = None
        if not config.moe.sparse_layers[index]:
            super()._load_mlp(config, weights, index, linear)
            return
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"experts with {config.hidden_act!r}: the fused MoE "
                                        f"op runs SiLU-gated experts only")
        self.moe = SparseMoeBlock(config.moe, weights, f"layers.{index}.{self.moe_prefix}",
                                  self.expert_names, linear, self.act_and_mul)

    @property
    def linears(self) -> tuple[Linear, ...]:
        if self.moe is None:
            return super().linears
        return self.qkv_proj, self.o_proj, *self.moe.linears

    @property
    def num_bytes(self) -> int:
        return super().num_bytes + (0 if self.moe is None else self.moe.num_expert_bytes)

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        return super()._mlp(hidden) if self.moe is None else self.moe(hidden)


class MixtralDecoderLayer(MoEDecoderLayer):
    moe_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, and Qwen3-MoE (the config adds q/k norms and drops the shared expert)."""
    layer_cls = MoEDecoderLayer
