"""A templated prompt's one-token-per-image placeholders -> the tokens each image takes.

The engine needs, per image, where its run of tokens sits (to put the vision embeddings
there, and to fold the image's content hash into the hashes of the blocks it covers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.tokenizer.multimodal.errors import MediaError


@dataclass(frozen=True)
class PlaceholderRange:
    """vLLM's name: an image's run of tokens in the expanded prompt."""
    offset: int
    length: int
    # Which positions of the run take an embedding; None: all of them.
    is_embed: tuple[bool, ...] | None = None


def expand_placeholders(token_ids: Sequence[int], placeholder_token_id: int,
                        replacements: Sequence[Sequence[int]], image_token_id: int,
                        ) -> tuple[list[int], list[PlaceholderRange]]:
    """Replaces the i-th `placeholder_token_id` with `replacements[i]`; returns the expanded
    ids and each image's range. The counts must agree: a mismatch means the prompt's text
    holds a placeholder of its own, or the template dropped an image."""
    positions = [i for i, token_id in enumerate(token_ids) if token_id == placeholder_token_id]
    if len(positions) != len(replacements):
        raise MediaError(f"the prompt has {len(positions)} image placeholder(s) for "
                         f"{len(replacements)} image(s)")
    expanded: list[int] = []
    ranges: list[PlaceholderRange] = []
    start = 0
    for position, replacement in zip(positions, replacements):
        expanded += token_ids[start:position]
        is_embed = tuple(token_id == image_token_id for token_id in replacement)
        ranges.append(PlaceholderRange(offset=len(expanded), length=len(replacement),
                                       is_embed=None if all(is_embed) else is_embed))
        expanded += replacement
        start = position + 1
    expanded += token_ids[start:]
    return expanded, ranges
