"""expand_placeholders: each image's placeholder becomes its run, and the ranges say where."""

from __future__ import annotations

import pytest

from services.tokenizer.multimodal import MediaError, PlaceholderRange, expand_placeholders

P, IMG, MARK = 9, 7, 8          # placeholder, image token, a marker token


def test_runs_replace_placeholders_in_order() -> None:
    expanded, ranges = expand_placeholders([1, P, 2, P, P, 3], P,
                                           [[IMG] * 2, [MARK, IMG, MARK], [IMG]], IMG)
    assert expanded == [1, IMG, IMG, 2, MARK, IMG, MARK, IMG, 3]
    assert ranges == [PlaceholderRange(1, 2), PlaceholderRange(4, 3, (False, True, False)),
                      PlaceholderRange(7, 1)]


def test_when_placeholder_and_image_token_are_one_token_only_the_prompts_count() -> None:
    expanded, ranges = expand_placeholders([P, 5], P, [[P, P, P]], P)
    assert expanded == [P, P, P, 5]
    assert ranges == [PlaceholderRange(0, 3)]


@pytest.mark.parametrize("token_ids, num_images", [([1, P, P], 1), ([1, 2], 1), ([P], 2)])
def test_counts_must_agree(token_ids: list[int], num_images: int) -> None:
    with pytest.raises(MediaError, match="image placeholder"):
        expand_placeholders(token_ids, P, [[IMG]] * num_images, IMG)


def test_no_images_leaves_the_prompt_alone() -> None:
    assert expand_placeholders([1, 2, 3], P, [], IMG) == ([1, 2, 3], [])
