"""4-bit codes in int32 words, as GPTQ and AWQ checkpoints store them.

GPTQ packs 8 codes of consecutive rows (qweight [K/8, N], along the input dim) or columns
(qzeros [G, N/8]) per word, code j at bits 4j. AWQ's GEMM format packs along the columns
(qweight [K, N/8], qzeros [G, N/8]) in an interleaved order: bit slot j holds column
AWQ_ORDER[j] of the word's 8 (AutoAWQ's order_map).
"""

from __future__ import annotations

import torch

CODES_PER_WORD = 8
SEQUENTIAL_ORDER = tuple(range(CODES_PER_WORD))
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> codes int32 [8R, C]: row 8r + j from bits 4j of row r (GPTQ qweight)."""
    codes = _nibbles(packed, dim=1)                  # [R, 8, C]
    return codes.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor,
                order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """int32 [R, C] -> codes int32 [R, 8C]: bit slot j of word c holds column 8c + order[j]."""
    codes = _nibbles(packed, dim=2)                  # [R, C, 8], by bit slot
    slot_of_column = torch.tensor([order.index(c) for c in range(CODES_PER_WORD)])
    return codes[:, :, slot_of_column].reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes [8R, C] (0..15) -> int32 [R, C]: the inverse of unpack_rows."""
    rows, cols = codes.shape
    grouped = codes.to(torch.int64).reshape(rows // CODES_PER_WORD, CODES_PER_WORD, cols)
    words = (grouped << _SHIFTS.to(codes.device)[None, :, None]).sum(dim=1)
    return _to_int32(words)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The 8 codes of each word, stacked along a new `dim` (bit slot order).
    NOTE: in int32: an arithmetic shift fills the high bits, which the mask drops."""
    shape = [1, 1, 1]
    shape[dim] = CODES_PER_WORD
    shifts = _SHIFTS.to(device=packed.device, dtype=torch.int32).view(shape)
    return (packed.unsqueeze(dim) >> shifts) & 0xF


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
