"""Where each Qwen2-VL patch sits, from the images' grids (t, h, w in patches).

The image processor emits an image's patches merge-block by merge-block: the m x m patches
that the PatchMerger later fuses into one token are adjacent rows (m = spatial_merge_size).
Every function here follows that order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

Grid = Sequence[int]   # (t, h, w): an image's temporal, height and width size in patches


def num_image_tokens(grid: Grid, spatial_merge_size: int) -> int:
    """Embeddings (placeholder tokens) one image becomes after the PatchMerger."""
    t, h, w = grid
    return t * h * w // spatial_merge_size ** 2


def patch_positions(grids: Sequence[Grid], spatial_merge_size: int) -> torch.Tensor:
    """(row, column) of every patch [num_patches, 2], in the processor's patch order."""
    m = spatial_merge_size
    positions = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        # merge-block-major: (block row, block column, row in block, column in block)
        pos = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], -1)
        positions.append(pos.repeat(t, 1))
    return torch.cat(positions)


def image_cu_seqlens(grids: Sequence[Grid]) -> list[int]:
    """Segment bounds for attention within each frame of each image: [0, h*w, ...]."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_index(grids: Sequence[Grid], spatial_merge_size: int, window_size: int,
                 patch_size: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the order of merge blocks that puts each window's blocks together
    [num_merge_blocks], and the windows' bounds in patches after that reordering.

    A window is window_size pixels square, so `window_size // patch_size // merge` merge blocks
    on a side; windows tile each frame from its top-left corner and the last row and column
    of windows may be partial.
    """
    side = window_size // spatial_merge_size // patch_size
    unit = spatial_merge_size ** 2
    order, bounds, offset = [], [0], 0
    for t, h, w in grids:
        bh, bw = h // spatial_merge_size, w // spatial_merge_size
        blocks = torch.arange(t * bh * bw).view(t, bh, bw)
        # NOTE: padded to whole windows with -1, then read window by window: what is left
        # of each window (after dropping the -1s) is its blocks in row-major order.
        pad_h, pad_w = -bh % side, -bw % side
        padded = F.pad(blocks, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (bh + pad_h) // side, (bw + pad_w) // side
        windows = padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        for window in windows:
            kept = window[window >= 0]
            if kept.numel():
                order.append(kept + offset)
                bounds.append(bounds[-1] + kept.numel() * unit)
        offset += t * bh * bw
    return torch.cat(order), bounds
