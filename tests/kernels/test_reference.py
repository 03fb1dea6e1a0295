"""The torch references against independent dense computations (no triton involved)."""

import torch
import torch.nn.functional as F

from kernels.reference import (
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    ref_reshape_and_cache,
)
from tests.kernels.paged_batch import make_paged_batch


def _dense_kv(batch, seq: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[Hkv, seq_len, D] keys and values of one sequence, read slot by slot."""
    slots = batch.slots(seq, range(seq_len))
    flat_k = batch.key_cache.view(-1, *batch.key_cache.shape[2:]).float()
    flat_v = batch.value_cache.view(-1, *batch.value_cache.shape[2:]).float()
    return flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)


def test_prefill_matches_sdpa_with_prefix() -> None:
    seq_lens, q_lens = [37, 5, 20], [4, 5, 1]
    batch = make_paged_batch(seq_lens, q_lens, 6, 2, 32, "float32", "cpu")
    out = ref_paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale, batch.max_query_len,
    )
    assert not out.isnan().any()
    for seq, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        k, v = _dense_kv(batch, seq, seq_len)
        start = int(batch.query_start_loc[seq])
        q = batch.query[start:start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        # Bottom-right aligned causal mask: query i sits at position seq_len - q_len + i.
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        want = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=batch.scale, enable_gqa=True
        )
        torch.testing.assert_close(out[start:start + q_len], want.transpose(0, 1))


def test_decode_is_last_position_of_full_attention() -> None:
    seq_lens = [1, 16, 33]
    batch = make_paged_batch(seq_lens, [1, 1, 1], 4, 4, 16, "float32", "cpu", block_size=8)
    out = ref_paged_decode_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.scale,
    )
    for seq, seq_len in enumerate(seq_lens):
        k, v = _dense_kv(batch, seq, seq_len)
        probs = (torch.einsum("hd,hkd->hk", batch.query[seq], k) * batch.scale).softmax(-1)
        torch.testing.assert_close(out[seq], torch.einsum("hk,hkd->hd", probs, v))


def test_reshape_and_cache_skips_negative_slots_and_quantizes() -> None:
    key = torch.tensor([[[1000.0, -2.0]], [[3.0, 4.0]]])  # [T=2, Hkv=1, D=2]
    value = -key
    key_cache = torch.zeros(2, 4, 1, 2, dtype=torch.float8_e4m3fn)
    value_cache = torch.zeros(2, 4, 1, 2, dtype=torch.float8_e4m3fn)
    ref_reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([5, -1]), 2.0, 1.0)
    assert key_cache[1, 1, 0].float().tolist() == [448.0, -1.0]  # 1000 / 2 saturates
    assert value_cache[1, 1, 0].float().tolist() == [-448.0, 2.0]
    assert key_cache.float().count_nonzero() == 2  # the skipped token wrote nothing


def test_sliding_window_and_soft_cap_match_dense_attention() -> None:
    seq_lens, q_lens, window, cap = [37, 12, 30], [9, 12, 1], 8, 2.0
    batch = make_paged_batch(seq_lens, q_lens, 4, 2, 16, "float32", "cpu")
    out = ref_paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale, sliding_window=window,
        logits_soft_cap=cap,
    )
    plain = ref_paged_prefill_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, batch.scale,
    )
    assert not torch.allclose(out, plain)  # the window and the cap both matter here
    for seq, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        k, v = _dense_kv(batch, seq, seq_len)
        start = int(batch.query_start_loc[seq])
        q = batch.query[start:start + q_len].transpose(0, 1)
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        scores = torch.tanh(q @ k.transpose(1, 2) * batch.scale / cap) * cap
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # HF: the last `window` keys
        want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(out[start:start + q_len], want.transpose(0, 1))
