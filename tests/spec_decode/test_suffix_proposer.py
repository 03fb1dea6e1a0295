"""Suffix decoding: drafts from the request's own tokens or from recent requests' outputs,
by frequency, as long as the matched suffix earns."""

from __future__ import annotations

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import pack_int32
from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.input_batch import InputBatch
from services.worker.spec_decode.suffix_proposer import SuffixProposer


def config(**overrides: object) -> SpeculativeConfig:
    values: dict = {"method": "suffix", "num_speculative_tokens": 4,
                    "suffix_decoding_max_tree_depth": 8, **overrides}
    return SpeculativeConfig(**values)


class Rows:
    """A persistent batch whose requests are given as token lists (prompt, then output)."""

    def __init__(self, max_reqs: int = 8) -> None:
        self.batch = InputBatch(max_reqs, 64, 8, [0], torch.device("cpu"))
        self.next_handle = 0

    def add(self, tokens: list[int], num_prompt_tokens: int | None = None) -> int:
        handle = self.next_handle
        self.next_handle += 1
        self.batch.add_request(wire_pb.NewRequestData(
            handle=handle, token_ids=pack_int32(tokens),
            num_prompt_tokens=len(tokens) if num_prompt_tokens is None else num_prompt_tokens))
        return self.batch.handle_to_row[handle]

    def drafts(self, proposer: SuffixProposer, rows: list[int]) -> list[list[int]]:
        batch = self.batch
        counts = proposer.propose(batch, np.array(rows))
        return [batch.token_ids[row, batch.num_tokens[row]:batch.num_tokens[row] + n].tolist()
                for row, n in zip(rows, counts.tolist())]


def test_the_request_s_own_tokens_are_a_source() -> None:
    rows = Rows()
    row = rows.add([1, 2, 3, 4, 1, 2, 3])
    assert rows.drafts(SuffixProposer(config(), 64), [row]) == [[4, 1, 2]]


def test_a_short_match_earns_a_short_draft() -> None:
    rows = Rows()
    row = rows.add([9, 5, 6, 7, 8, 5])   # only [5] matches: one draft
    assert rows.drafts(SuffixProposer(config(), 64), [row]) == [[6]]
    doubled = SuffixProposer(config(suffix_decoding_max_spec_factor=2.0), 64)
    assert rows.drafts(doubled, [row]) == [[6, 7]]


def test_the_most_frequent_continuation_is_drafted_while_likely_enough() -> None:
    rows = Rows()
    row = rows.add([5, 6, 1, 5, 6, 2, 5, 7, 3, 5])   # after 5: 6 twice, 7 once
    likely = config(suffix_decoding_max_spec_factor=4.0, suffix_decoding_min_token_prob=0.5)
    # 6 (2/3), then 1 or 2 (half of those each: 1/3 of the way, too unlikely).
    assert rows.drafts(SuffixProposer(likely, 64), [row]) == [[6]]
    picky = SuffixProposer(config(suffix_decoding_min_token_prob=0.7), 64)
    assert rows.drafts(picky, [row]) == [[]]


def test_outputs_of_finished_requests_are_drafted_from() -> None:
    rows = Rows()
    proposer = SuffixProposer(config(), 64)
    finished = rows.add([1, 1, 10, 11, 12, 13, 14], num_prompt_tokens=2)
    proposer.remember(rows.batch, [finished])
    rows.batch.remove_request(0)
    row = rows.add([7, 8, 10, 11, 12])
    assert rows.drafts(proposer, [row]) == [[13, 14]]
    assert rows.drafts(SuffixProposer(config(), 64), [row]) == [[]]   # nothing cached


def test_the_cache_keeps_the_latest_requests_only() -> None:
    rows = Rows()
    proposer = SuffixProposer(config(suffix_decoding_max_cached_requests=1), 64)
    for output in ([20, 21, 22, 23], [30, 31, 32, 33]):
        finished = rows.add([1, *output], num_prompt_tokens=1)
        proposer.remember(rows.batch, [finished])
    early, late = rows.add([20, 21]), rows.add([30, 31])
    assert rows.drafts(proposer, [early, late]) == [[], [32, 33]]
