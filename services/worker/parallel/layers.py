"""The collectives a sharded model needs, as drop-in replacements for its parts: a
row-parallel linear all-reduces its partial sums, the LM head gathers each rank's vocabulary
share of the logits, and the embedding looks up the rows this rank holds and sums over ranks
(one rank holds each token's row: the sum is exact)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from services.worker.models.llama import LlamaForCausalLM
from services.worker.parallel.group import TensorParallelGroup
from services.worker.parallel.sharding import ShardPlan


class RowParallelLinear:
    """A linear over this rank's input columns: y = all_reduce(x_r W_r^T)."""

    def __init__(self, linear: Any, group: TensorParallelGroup):
        if getattr(linear, "bias", None) is not None:
            raise ValueError("a row-parallel linear with a bias would add it once per rank")
        self.linear = linear
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))

    def __getattr__(self, name: str) -> Any:   # num_bytes and the like: the local linear's
        return getattr(self.linear, name)


class VocabParallelHead:
    """The LM head over this rank's vocabulary rows; every rank gets the whole logits."""

    def __init__(self, linear: Any, group: TensorParallelGroup, sizes: list[int]):
        self.linear = linear
        self.group = group
        self.sizes = sizes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.linear(hidden), self.sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.linear, name)


class VocabParallelEmbedding:
    """Rows [start, end) of the embedding; a token outside them contributes zeros here."""

    def __init__(self, weight: torch.Tensor, start: int, group: TensorParallelGroup):
        self.weight = weight
        self.start = start
        self.group = group

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(hidden)


def parallelize(model: LlamaForCausalLM, plan: ShardPlan, group: TensorParallelGroup) -> None:
    """Puts the collectives into a model built from ShardedWeights."""
    for layer in model.layers:
        layer.o_proj = RowParallelLinear(layer.o_proj, group)
        layer.down_proj = RowParallelLinear(layer.down_proj, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, plan.vocab_sizes)
    model.embedding = VocabParallelEmbedding(model.embed_tokens, plan.vocab[0], group)
