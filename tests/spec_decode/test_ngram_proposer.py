"""Prompt lookup over a batch of rows of different lengths."""

from __future__ import annotations

import torch

from services.common import wire_pb
from services.common.packing import pack_int32
from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.input_batch import InputBatch
from services.worker.spec_decode.ngram_proposer import NgramProposer


def propose(rows_tokens: list[list[int]], k: int = 3, low: int = 1, high: int = 3,
            max_model_len: int = 64) -> list[list[int]]:
    batch = InputBatch(len(rows_tokens), max_model_len, 8, [0], torch.device("cpu"))
    for handle, tokens in enumerate(rows_tokens):
        batch.add_request(wire_pb.NewRequestData(handle=handle, token_ids=pack_int32(tokens),
                                              num_prompt_tokens=len(tokens)))
    rows = batch.rows_of(list(range(len(rows_tokens))))
    proposer = NgramProposer(SpeculativeConfig("ngram", k, low, high), max_model_len)
    counts = proposer.propose(batch, rows)
    assert counts.tolist() == batch.num_draft_tokens[rows].tolist()
    return [batch.token_ids[row, len(tokens):len(tokens) + n].tolist()
            for row, tokens, n in zip(rows.tolist(), rows_tokens, counts.tolist())]


def test_drafts_follow_the_suffix_and_may_run_into_it() -> None:
    assert propose([[1, 2, 3, 4, 1, 2, 3]]) == [[4, 1, 2]]


def test_the_longest_matching_suffix_wins() -> None:
    # [6] last occurred before 8, but [5, 6] occurred before 9.
    assert propose([[5, 6, 9, 7, 6, 8, 5, 6]], high=2) == [[9, 7, 6]]


def test_of_equal_matches_the_most_recent_wins() -> None:
    assert propose([[1, 2, 7, 1, 2, 8, 1, 2]], high=2) == [[8, 1, 2]]


def test_no_match_of_prompt_lookup_min_tokens_gives_no_drafts() -> None:
    assert propose([[1, 2, 3, 4, 5, 3]], low=2) == [[]]
    assert propose([[1, 2, 3, 4, 5, 3]], low=1) == [[4, 5, 3]]


def test_rows_of_different_lengths_share_one_pass() -> None:
    rows = [[3, 3], [9, 8, 7, 6, 5, 9, 8], [4], [1, 2, 1, 2, 1, 2, 1, 2, 1, 2]]
    assert propose(rows, k=4) == [[3], [7, 6, 5, 9], [], [1, 2, 1, 2]]


def test_drafts_stop_at_max_model_len() -> None:
    assert propose([[1, 2, 3, 1, 2]], k=3, max_model_len=6) == [[3]]
