"""What each tensor-parallel rank holds: a contiguous share of the KV heads (with the query
heads of their groups), of the MLP's intermediate columns, and of the vocabulary.

Shares differ by at most one unit, so a model whose head count the rank count does not divide
still splits (SmolLM2's 3 KV heads over 2 ranks: 2 and 1, with 6 and 3 query heads). Weights
are sliced as they are read: column-parallel linears (q/k/v, gate/up, the LM head) by output
rows, row-parallel ones (o_proj, down_proj) by input columns, the embedding by vocabulary rows.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from services.worker.models.config import ModelConfig
from services.worker.models.weights import WeightSource


def share(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s contiguous share of `total` units; the first ranks take one
    more where `total` does not divide."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class ShardPlan:
    model_config: ModelConfig   # the whole model's
    rank: int
    world_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        if config.num_key_value_heads < world_size:
            raise ValueError(
                f"--tensor-parallel-size {world_size} exceeds the model's "
                f"{config.num_key_value_heads} KV heads: each rank needs at least one")
        if config.moe is not None:
            raise ValueError("tensor parallelism runs dense models; this one is a "
                             "mixture of experts (use --tensor-parallel-size 1)")
        return cls(config, rank, world_size)

    @property
    def num_heads(self) -> int:
        return self.model_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.model_config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.model_config.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.model_config.intermediate_size

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_heads(self) -> tuple[int, int]:
        return share(self.num_kv_heads, self.world_size, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        group = self.num_heads // self.num_kv_heads   # query heads per KV head
        start, end = self.kv_heads
        return start * group, end * group

    @property
    def intermediate(self) -> tuple[int, int]:
        return share(self.intermediate_size, self.world_size, self.rank)

    @property
    def vocab(self) -> tuple[int, int]:
        return share(self.vocab_size, self.world_size, self.rank)

    @property
    def vocab_sizes(self) -> list[int]:
        """Every rank's vocabulary share, in rank order (the LM head gathers them)."""
        return [end - start for start, end in
                (share(self.vocab_size, self.world_size, r) for r in range(self.world_size))]

    @property
    def rank_config(self) -> ModelConfig:
        """The model as this rank builds it: its heads and MLP columns (scale and head_dim
        are the whole model's)."""
        config = self.model_config
        (q0, q1), (kv0, kv1), (i0, i1) = self.q_heads, self.kv_heads, self.intermediate
        return dataclasses.replace(config, num_attention_heads=q1 - q0,
                                   num_key_value_heads=kv1 - kv0, intermediate_size=i1 - i0,
                                   attention_scale=config.scale)

    def row_ranges(self, name: str) -> list[tuple[int, int, int]] | None:
        """For a column-parallel tensor, the (part size, start, end) of each fused part's rows
        this rank keeps; None if the tensor is not split by rows."""
        d = self.head_dim
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        (q0, q1), (kv0, kv1), (i0, i1) = self.q_heads, self.kv_heads, self.intermediate
        q, kv = (q_rows, q0 * d, q1 * d), (kv_rows, kv0 * d, kv1 * d)
        mlp = (self.intermediate_size, i0, i1)
        kind = _kind(name)
        return {"q_proj": [q], "k_proj": [kv], "v_proj": [kv], "qkv_proj": [q, kv, kv],
                "gate_proj": [mlp], "up_proj": [mlp], "gate_up_proj": [mlp, mlp],
                "vocab": [(self.vocab_size, *self.vocab)]}.get(kind)

    def column_range(self, name: str) -> tuple[int, int] | None:
        """For a row-parallel weight, the input columns this rank keeps; None otherwise."""
        kind = _kind(name)
        if kind == "o_proj":
            start, end = self.q_heads
            return start * self.head_dim, end * self.head_dim
        return self.intermediate if kind == "down_proj" else None


# Dense layers only: an MoE's experts (mlp.experts.N...) and shared expert stay whole.
_SPLIT = re.compile(r"^layers\.\d+\.(?:self_attn|mlp)\.(\w+_proj)\.(?:weight|bias)$")


def _kind(name: str) -> str | None:
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return "vocab"
    match = _SPLIT.match(name)
    return match.group(1) if match else None


class ShardedWeights(WeightSource):
    """A WeightSource that hands out this rank's slice of each split tensor (and whole
    tensors otherwise), slicing before the dtype conversion and copy."""

    def __init__(self, weights: WeightSource, plan: ShardPlan):
        self.__dict__.update(weights.__dict__)   # the same open files, dtype and device
        self.plan = plan

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        try:
            handle, stored_name = self._name_to_handle[name]
        except KeyError:
            raise KeyError(f"weight {name!r} missing from the checkpoint") from None
        tensor = handle.get_slice(stored_name)
        rows, columns = self.plan.row_ranges(name), self.plan.column_range(name)
        if rows is not None:
            parts, offset = [], 0
            for size, start, end in rows:
                parts.append(tensor[offset + start:offset + end])
                offset += size
            full = torch.cat(parts) if len(parts) > 1 else parts[0]
        elif columns is not None:
            full = tensor[:, columns[0]:columns[1]]
        else:
            full = tensor[:]
        return full.to(device=self.device, dtype=dtype or self.dtype).contiguous()
