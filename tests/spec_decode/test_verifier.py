"""The verifier in isolation: greedy accepts exactly the argmax prefix plus one token, and
sampling with drafts keeps the target distribution (a chi-square test that a verifier with
a planted bias fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common import wire_pb
from services.common.packing import pack_int32
from services.worker.runner.input_batch import InputBatch
from services.worker.sampling.sampler import Sampler
from services.worker.sampling.sampling_metadata import build_sampling_metadata
from services.worker.spec_decode.verifier import DraftVerifier

VOCAB = 12
CPU = torch.device("cpu")


def make_batch(num_reqs: int, sampling: wire_pb.SamplingParams,
               drafts: list[int]) -> tuple[InputBatch, np.ndarray]:
    """num_reqs requests of one prompt token, each holding `drafts`."""
    batch = InputBatch(num_reqs, 32, 4, [0], CPU)
    for handle in range(num_reqs):
        batch.add_request(wire_pb.NewRequestData(handle=handle, token_ids=pack_int32([1]),
                                              num_prompt_tokens=1, block_ids=pack_int32([1]),
                                              sampling=sampling))
    rows = batch.rows_of(list(range(num_reqs)))
    batch.token_ids[rows, 1:1 + len(drafts)] = drafts
    batch.num_draft_tokens[rows] = len(drafts)
    return batch, rows


def verify(batch: InputBatch, rows: np.ndarray, logits: torch.Tensor, sampler: Sampler,
           verifier_cls: type[DraftVerifier] = DraftVerifier
           ) -> tuple[np.ndarray, np.ndarray]:
    """logits: [positions, vocab] of one request, the same for every request. Returns the
    drafts each request accepted and its emitted tokens (-1 padded)."""
    num_drafts = batch.num_draft_tokens[rows].astype(np.int64)
    positions = np.repeat(rows, num_drafts + 1)
    md = build_sampling_metadata(batch, positions, VOCAB, CPU)
    verifier = verifier_cls(batch, rows, num_drafts, md)
    sampled = sampler(logits.repeat(len(rows), 1), md).sampled_token_ids.numpy()
    num_accepted, emitted = verifier.verify(sampled)
    tokens = np.where(emitted, sampled, -1).reshape(len(rows), -1)
    return num_accepted, tokens


def test_greedy_accepts_the_argmax_prefix_and_one_more() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1).tolist()
    wrong = (argmax[1] + 1) % VOCAB
    batch, rows = make_batch(1, wire_pb.SamplingParams(), [argmax[0], wrong, argmax[2]])
    num_accepted, tokens = verify(batch, rows, logits, Sampler(CPU, 0))
    assert num_accepted.tolist() == [1]
    assert tokens.tolist() == [[argmax[0], argmax[1], -1, -1]]
    batch, rows = make_batch(1, wire_pb.SamplingParams(), argmax[:3])
    num_accepted, tokens = verify(batch, rows, logits, Sampler(CPU, 0))
    assert num_accepted.tolist() == [3] and tokens.tolist() == [argmax]


# ---- the statistical test -------------------------------------------------------------

def target_probs(logits: torch.Tensor, top_p: float) -> np.ndarray:
    """Temperature 1, then top-p: the smallest most-likely-first set reaching p."""
    probs = logits.softmax(dim=-1).numpy().astype(np.float64)
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs)
    kept[order[before < top_p]] = probs[order[before < top_p]]
    return kept / kept.sum()


class PlantedBiasVerifier(DraftVerifier):
    """The textbook mistake: accept the draft with probability p(x), and on rejection emit
    a sample from p without zeroing x (so x comes out too often)."""

    p_draft = 0.0
    rng = np.random.default_rng(1)

    def verify(self, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = self.first_position
        accept = self.rng.random(len(first)) < self.p_draft
        sampled[first[accept]] = self.drafts.reshape(len(first), -1)[accept, 0]
        return super().verify(sampled)


def emitted_outcome_counts(top_p: float, verifier_cls: type[DraftVerifier]
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Over many seeded trials of one draft x: counts of the step's emitted tokens as
    outcomes (first token t != x) or (x, the bonus token t), and their target
    probabilities p0(t) and p0(x) * p1(t)."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    p0, p1 = target_probs(logits[0], top_p), target_probs(logits[1], top_p)
    draft = int(np.argsort(-p0)[1])   # the second most likely: accepted now and then
    PlantedBiasVerifier.p_draft = p0[draft]
    batch, rows = make_batch(128, wire_pb.SamplingParams(temperature=1.0, top_p=top_p), [draft])
    sampler = Sampler(CPU, 0)
    counts = np.zeros(2 * VOCAB)
    for _ in range(160):
        _, tokens = verify(batch, rows, logits, sampler, verifier_cls)
        accepted = tokens[:, 0] == draft
        np.add.at(counts, tokens[~accepted, 0], 1)
        np.add.at(counts, VOCAB + tokens[accepted, 1], 1)
    expected = np.concatenate((np.where(np.arange(VOCAB) == draft, 0.0, p0),
                               p0[draft] * p1))
    return counts, expected


def chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's test over the outcomes the target can produce; an outcome it cannot
    produce (probability 0) that occurs fails outright."""
    possible = expected_probs > 0
    if counts[~possible].any():
        return 0.0
    expected = expected_probs[possible] * counts.sum()
    statistic = float(((counts[possible] - expected) ** 2 / expected).sum())
    df = int(possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_speculation_keeps_the_target_distribution(top_p: float) -> None:
    counts, expected = emitted_outcome_counts(top_p, DraftVerifier)
    assert chi_square_p_value(counts, expected) > 1e-3


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_same_test_fails_a_verifier_with_a_planted_bias(top_p: float) -> None:
    counts, expected = emitted_outcome_counts(top_p, PlantedBiasVerifier)
    assert chi_square_p_value(counts, expected) < 1e-6
