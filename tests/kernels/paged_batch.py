"""Random paged-KV batches for kernel tests, with every unused cache slot poisoned with NaN.

A kernel that reads a slot it must not (past seq_len, the null block, a padded block-table
entry) turns its output into NaN, which the comparison with the reference then catches.
"""

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D], T = sum(q_lens)
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    scale: float
    k_scale: float | None
    v_scale: float | None

    def slots(self, seq: int, positions: range) -> torch.Tensor:
        """int64 cache slots of the given token positions of one sequence."""
        block_size = self.key_cache.shape[1]
        pos = torch.tensor(list(positions), dtype=torch.long)
        blocks = self.block_tables[seq].cpu().long()[pos // block_size]
        return (blocks * block_size + pos % block_size).to(self.key_cache.device)


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    device: str,
    block_size: int = 16,
    fp8_cache: bool = False,
    query_from_qkv: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """Sequences with distinct, shuffled blocks (never block 0) and random K/V at used slots."""
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = DTYPES[dtype]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # null block + used + a couple never touched
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"))
    value_cache = torch.full(cache_shape, float("nan"))
    for seq, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        blocks = block_tables[seq].long()[pos // block_size]
        for cache in (key_cache, value_cache):
            cache[blocks, pos % block_size] = torch.randn(
                seq_len, num_kv_heads, head_dim, generator=gen
            )

    k_scale = v_scale = None
    if fp8_cache:
        # Scales a real calibration might give (amax / 448), so values use the fp8 range.
        k_scale, v_scale = 4.0 / 448.0, 3.0 / 448.0
        key_cache = (key_cache / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        value_cache = (value_cache / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        key_cache, value_cache = key_cache.to(torch_dtype), value_cache.to(torch_dtype)

    num_tokens = sum(q_lens)
    if query_from_qkv:
        # A view into a fused qkv projection output: token stride larger than Hq * D.
        qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        query = qkv.to(torch_dtype).to(device)[:, : num_q_heads * head_dim]
        query = query.view(num_tokens, num_q_heads, head_dim)
    else:
        query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(torch_dtype)
        query = query.to(device)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens).cumsum(0)
    return PagedBatch(
        query=query,
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        max_query_len=max(q_lens),
        scale=head_dim**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )


# Attention against the fp32 reference on a GPU, where fp16 / bf16 tiles are multiplied in
# their own dtype (probabilities rounded to it before P @ V); the interpreter upcasts them.
GPU_DOT_TOLERANCE = {torch.float32: 5e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, device: str) -> None:
    """Tolerances per dtype: output rounding on CPU (fp32 dots), fp16/bf16 dots on a GPU."""
    if device != "cpu":
        tol = GPU_DOT_TOLERANCE[expected.dtype]
    else:
        tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[expected.dtype]
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
