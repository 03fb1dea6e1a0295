"""Qwen2-VL's multimodal rope (M-RoPE): three position rows (temporal, height, width).

A text token has the same position in all three rows, one more than the token before. An
image's placeholder tokens (one per merged patch) all start where the text before it ended:
row 0 (temporal) stays there, rows 1 and 2 add the token's row and column in the image's
merged grid; the text after the image continues at start + max(grid height, grid width). So a
prompt with images spans fewer positions than tokens; `delta` (max position + 1 - prompt
length) carries that into decode, where token i of the sequence has position i + delta in
every row.

In the attention, each head's rotary frequencies are cut into `mrope_section` chunks (over
head_dim / 2, repeated for the second half): chunk j rotates by the position in row j % 3.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from services.worker.models.rotary import RotaryEmbedding
from services.worker.models.vision.qwen2_vl_grid import Grid


def mrope_positions(token_ids: Sequence[int] | torch.Tensor, image_token_id: int,
                    image_grid_thw: torch.Tensor | Sequence[Grid],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) of a prompt whose images are runs of `image_token_id`
    (t * h * w / merge^2 each, in image_grid_thw order), and the decode delta.

    Equal to HF's Qwen2VLModel.get_rope_index for text and images. Images are cut from the
    placeholder runs by their grids' sizes (HF groups a run, so two images need text, such as
    <|vision_end|><|vision_start|>, between them there). Raises ValueError if the placeholders
    do not add up to the grids.
    """
    ids = torch.as_tensor(token_ids)
    grids = (image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor)
             else image_grid_thw)
    image_tokens = (ids == image_token_id).nonzero().flatten().tolist()
    pieces: list[torch.Tensor] = []
    cursor = 0       # next token to place
    position = 0     # next free position
    m = spatial_merge_size
    for t, h, w in grids:
        first = bisect.bisect_left(image_tokens, cursor)
        if first == len(image_tokens):
            raise ValueError(f"{len(grids)} images but fewer placeholder runs in the prompt")
        start = image_tokens[first]
        pieces.append(_text_positions(start - cursor, position))
        position += start - cursor
        gt, gh, gw = int(t), int(h) // m, int(w) // m
        num_tokens = gt * gh * gw
        if (start + num_tokens > len(ids)
                or not bool((ids[start:start + num_tokens] == image_token_id).all())):
            raise ValueError(f"an image of grid {(t, h, w)} needs {num_tokens} placeholders")
        rows = torch.stack(torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw),
                                          indexing="ij")).reshape(3, -1)
        pieces.append(rows + position)
        # NOTE: HF advances by the merged grid's larger side, whatever t is.
        position += max(gh, gw)
        cursor = start + num_tokens
    if image_tokens and image_tokens[-1] >= cursor:
        raise ValueError("more image placeholders in the prompt than image grids")
    pieces.append(_text_positions(len(ids) - cursor, position))
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta


def _text_positions(num_tokens: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + num_tokens).expand(3, -1)


def mrope_decode_positions(delta: int, start: int, end: int) -> torch.Tensor:
    """Positions [3, end - start] of sequence tokens start..end-1 past the prompt."""
    return (torch.arange(start, end) + delta).expand(3, -1)


def mrope_section_from_hf(config: dict[str, Any]) -> list[int]:
    """mrope_section from a Qwen2-VL / Qwen2.5-VL config.json (text_config.rope_parameters in
    transformers 5, the top level's rope_scaling before)."""
    for scope in (config.get("text_config") or {}, config):
        for key in ("rope_parameters", "rope_scaling"):
            section = (scope.get(key) or {}).get("mrope_section")
            if section is not None:
                return list(section)
    raise ValueError("no mrope_section in the config")


class MRotaryEmbedding:
    """The text model's rope for M-RoPE positions [3, num_tokens]; 1-D positions (text-only
    steps) look up as plain rope, which M-RoPE equals when the three rows agree.

    NOTE: the tables are RotaryEmbedding's (the same fp32 arithmetic as HF, rotate_half's sign
    folded into sin); a lookup picks, for each column, the row its mrope_section chunk follows.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 mrope_section: Sequence[int], dtype: torch.dtype, device: torch.device,
                 ops: ModuleType | None = None):
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 "
                             f"({head_dim // 2})")
        self.rotary = RotaryEmbedding(head_dim, max_position, theta, None, dtype, device, ops)
        half = torch.cat([torch.full((size,), j % 3) for j, size in enumerate(mrope_section)])
        self.column_rows = torch.cat((half, half)).to(device)   # [head_dim]: row 0, 1 or 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] for positions [3, num_tokens] (or [num_tokens])."""
        if positions.dim() == 1:
            return self.rotary.lookup(positions)
        index = self.column_rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.rotary.cos_cache[positions].gather(0, index)[0]
        sin = self.rotary.sin_cache[positions].gather(0, index)[0]
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [num_tokens, num_heads, head_dim] (RotaryEmbedding.apply)."""
        return self.rotary.apply(x, cos, sin)
