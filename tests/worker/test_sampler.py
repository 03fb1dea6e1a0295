"""The sampler against simple per-row references (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common import wire_pb
from services.common.packing import pack_float32, pack_int32
from services.worker.runner.input_batch import InputBatch
from services.worker.sampling import sampler as sampler_module
from services.worker.sampling.sampler import (
    Sampler,
    apply_logits_processing,
    apply_min_p,
    candidate_probs,
)
from services.worker.sampling.sampling_metadata import SamplingMetadata, build_sampling_metadata

VOCAB = 64
EOS = 2
NEG_INF = float("-inf")


def metadata(params: list[wire_pb.SamplingParams], prompts: list[list[int]] | None = None,
             outputs: list[list[int]] | None = None) -> SamplingMetadata:
    """Sampling metadata for one request per params entry, through the real persistent batch."""
    prompts = prompts or [[5, 6, 7]] * len(params)
    outputs = outputs or [[]] * len(params)
    batch = InputBatch(len(params), 64, 4, [EOS], torch.device("cpu"))
    for handle, (sp, prompt, out) in enumerate(zip(params, prompts, outputs)):
        batch.add_request(wire_pb.NewRequestData(
            handle=handle, token_ids=pack_int32(prompt + out), num_prompt_tokens=len(prompt),
            block_ids=pack_int32([1]), sampling=sp))
    return build_sampling_metadata(batch, batch.rows_of(list(range(len(params)))), VOCAB,
                                   torch.device("cpu"))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_batch_is_an_argmax_fast_path() -> None:
    md = metadata([wire_pb.SamplingParams(temperature=0.0)] * 3)
    assert md.all_greedy and md.temperature is None and not md.needs_processing
    logits = random_logits(3)
    out = Sampler(torch.device("cpu"), 0)(logits.clone(), md)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    md = metadata([wire_pb.SamplingParams(temperature=0.0), wire_pb.SamplingParams(temperature=1.0),
                   wire_pb.SamplingParams(temperature=0.0)])
    logits = random_logits(3)
    out = Sampler(torch.device("cpu"), 0)(logits.clone(), md).sampled_token_ids
    assert out[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def _seeded_tokens(batch_params: list[wire_pb.SamplingParams], logits_rows: list[torch.Tensor],
                   index: int, steps: int = 6) -> list[int]:
    md = metadata(batch_params)  # fresh generators, as for newly added requests
    sampler = Sampler(torch.device("cpu"), seed=123)
    tokens = []
    for step in range(steps):
        logits = torch.stack([row + step for row in logits_rows])
        tokens.append(int(sampler(logits, md).sampled_token_ids[index]))
    return tokens


def test_seeded_requests_reproduce_whatever_the_batch_around_them() -> None:
    mine = wire_pb.SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=7)
    row = random_logits(1, seed=1)[0]
    others = random_logits(4, seed=2)
    alone = _seeded_tokens([mine], [row], 0)
    first = _seeded_tokens([wire_pb.SamplingParams(temperature=1.0), mine,
                            wire_pb.SamplingParams(temperature=0.5, seed=3)],
                           [others[0], row, others[1]], 1)
    last = _seeded_tokens([wire_pb.SamplingParams(temperature=0.0),
                           wire_pb.SamplingParams(temperature=2.0, min_p=0.1),
                           wire_pb.SamplingParams(temperature=0.7), mine],
                          [others[2], others[3], others[0], row], 3)
    assert alone == first == last
    assert len(set(alone)) > 1  # it does sample (with these logits, not always the argmax)
    other_seed = _seeded_tokens([wire_pb.SamplingParams(temperature=1.3, top_k=20, top_p=0.9,
                                                     seed=8)], [row], 0)
    assert other_seed != alone


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((4000, VOCAB), NEG_INF)
    logits[:, :4] = probs.log()
    md = metadata([wire_pb.SamplingParams(temperature=1.0)] * 4000)
    sampled = Sampler(torch.device("cpu"), 0)(logits, md).sampled_token_ids
    freq = torch.bincount(sampled, minlength=4)[:4].float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def _ref_distribution(logits: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """One row's sampling distribution, the obvious way (float64): min-p, top-k, top-p."""
    probs = logits.double().softmax(-1)
    kept = [t for t in range(VOCAB) if probs[t] >= min_p * probs.max()]
    kept.sort(key=lambda t: -float(probs[t]))
    if k:
        kept = kept[:k]
    if p < 1.0:
        total, nucleus = float(probs[kept].sum()), []
        for token in kept:
            nucleus.append(token)
            if float(probs[nucleus].sum()) >= p * total:
                break
        kept = nucleus
    out = torch.zeros(VOCAB, dtype=torch.float64)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def _distribution(token_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    dense = torch.zeros(probs.shape[0], VOCAB, dtype=torch.float64)
    dense.scatter_(1, token_ids, probs.double())
    return dense / dense.sum(-1, keepdim=True)


@pytest.mark.parametrize("num_candidates", [None, VOCAB], ids=["candidates", "whole_row"])
def test_top_k_top_p_min_p_match_reference(num_candidates: int | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 12)
    ks = [0, 1, 5, 10, 30, 3, 0, 7, 0, 20, 0]
    ps = [1.0, 0.5, 0.9, 0.3, 0.95, 1.0, 0.6, 0.99, 0.999, 1.0, 1.0]
    min_ps = [0.0, 0.0, 0.1, 0.0, 0.02, 0.0, 0.0, 0.3, 0.0, 0.05, 0.2]
    logits = random_logits(len(ks), seed=4) * 0.5  # flat enough for wide nuclei
    token_ids, probs, exact = candidate_probs(
        logits, torch.tensor(ks), torch.tensor([p if p < 1 else float("inf") for p in ps]),
        torch.tensor(min_ps), num_candidates=num_candidates)
    got = _distribution(token_ids, probs)
    if num_candidates == VOCAB:
        assert bool(exact.all())
    else:
        assert not bool(exact[8]) and bool(exact[1])  # p=0.999 needs more than 12 candidates
    for i, (k, p, m) in enumerate(zip(ks, ps, min_ps)):
        if bool(exact[i]):
            want = _ref_distribution(logits[i], k, p, m)
            assert torch.equal(got[i] > 0, want > 0), i
            assert torch.allclose(got[i], want, atol=1e-6), i


def test_ranked_rows_draw_the_same_token_on_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A nucleus row sampled among few candidates (inexact, redone on the whole row) or many
    (exact) is the same draw: both walk the distribution in rank order."""
    logits = random_logits(1, seed=9)[0] * 0.3
    mine = wire_pb.SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 4)
    few = _seeded_tokens([mine], [logits], 0)
    many = _seeded_tokens([wire_pb.SamplingParams(temperature=1.0, top_k=VOCAB), mine],
                          [logits, logits], 1)
    assert few == many


def test_top_k_sampling_draws_only_the_top_k() -> None:
    logits = torch.full((3000, VOCAB), -5.0)
    logits[:, 10], logits[:, 20], logits[:, 30] = 2.0, 2.0 + float(np.log(3.0)), 1.0
    md = metadata([wire_pb.SamplingParams(temperature=1.0, top_k=2)] * 3000)
    sampled = Sampler(torch.device("cpu"), 0)(logits, md).sampled_token_ids
    counts = torch.bincount(sampled, minlength=VOCAB)
    assert counts.sum() == counts[10] + counts[20]
    assert abs(float(counts[20]) / 3000 - 0.75) < 0.03


def test_min_p_mask_matches_reference() -> None:
    min_p = [0.0, 0.05, 0.3, 1.0]
    logits = random_logits(4, seed=6)
    got = logits.clone()
    apply_min_p(got, torch.tensor(min_p))
    for i, m in enumerate(min_p):
        probs = logits[i].softmax(-1)
        assert torch.equal(got[i].isinf(), probs < m * probs.max())


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    params = [wire_pb.SamplingParams(temperature=0.8, top_k=5, logprobs=4, repetition_penalty=1.5),
              wire_pb.SamplingParams(temperature=0.0),
              wire_pb.SamplingParams(temperature=0.0, logprobs=0, logit_bias_token_ids=pack_int32(
                  [9]), logit_bias_values=pack_float32([100.0]))]
    md = metadata(params)
    logits = random_logits(3, seed=7)
    out = Sampler(torch.device("cpu"), 0)(logits.clone(), md)
    assert md.logprob_rows.tolist() == [0, 2] and md.max_num_logprobs == 4
    raw = logits[[0, 2]].log_softmax(-1)
    sampled = out.sampled_token_ids[[0, 2]]
    assert sampled[1] == 9  # the bias decided the token; the logprob stays the model's
    assert torch.allclose(out.logprobs, raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(4)
    assert torch.equal(out.top_token_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)


def _ref_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float,
                   presence: float, frequency: float) -> torch.Tensor:
    out = logits.clone()
    for token in range(VOCAB):
        count = output.count(token)
        if token in prompt or count:
            out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
        out[token] -= frequency * count + presence * (count > 0)
    return out


def test_penalties_and_logit_bias_match_reference() -> None:
    prompts = [[3, 4, 5, 5], [10, 11], [7]]
    outputs = [[5, 6, 6, 6], [], [7, 8]]
    params = [wire_pb.SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                                  frequency_penalty=0.25),
              wire_pb.SamplingParams(repetition_penalty=2.0),
              wire_pb.SamplingParams(presence_penalty=-1.0, logit_bias_token_ids=pack_int32([1, 8]),
                                  logit_bias_values=pack_float32([2.5, -4.0]))]
    md = metadata(params, prompts, outputs)
    logits = random_logits(3, seed=8)
    got = logits.clone()
    apply_logits_processing(got, md)
    for i, sp in enumerate(params):
        want = _ref_penalties(logits[i], prompts[i], outputs[i], sp.repetition_penalty or 1.0,
                              sp.presence_penalty, sp.frequency_penalty)
        if i == 2:
            want[1] += 2.5
            want[8] -= 4.0
        assert torch.allclose(got[i], want, atol=1e-6), i


def test_each_draft_position_is_penalised_for_the_drafts_before_it() -> None:
    """A row verifying drafts samples at 1 + drafts positions; position j sees the output a
    one-token-at-a-time decode would have: the known output plus drafts 0..j-1."""
    prompt, output, drafts = [3, 4], [5, 6], [6, 9, 9]
    sp = wire_pb.SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)
    batch = InputBatch(1, 64, 4, [EOS], torch.device("cpu"))
    batch.add_request(wire_pb.NewRequestData(handle=0, token_ids=pack_int32(prompt + output),
                                          num_prompt_tokens=len(prompt),
                                          block_ids=pack_int32([1]), sampling=sp))
    row = int(batch.rows_of([0])[0])
    batch.token_ids[row, 4:7] = drafts   # where the proposer writes them
    md = build_sampling_metadata(batch, np.repeat(row, 4), VOCAB, torch.device("cpu"))
    logits = random_logits(1, seed=3).repeat(4, 1)
    got = logits.clone()
    apply_logits_processing(got, md)
    for j in range(4):
        want = _ref_penalties(logits[j], prompt, output + drafts[:j], 1.5, 0.5, 0.3)
        assert torch.allclose(got[j], want, atol=1e-6), j


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    stop = pack_int32([11])
    params = [wire_pb.SamplingParams(min_tokens=2, stop_token_ids=stop),
              wire_pb.SamplingParams(min_tokens=2, stop_token_ids=stop),
              wire_pb.SamplingParams(min_tokens=2, stop_token_ids=stop, ignore_eos=True)]
    md = metadata(params, outputs=[[20], [20, 21], [20]])
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 11] = 9.0
    out = Sampler(torch.device("cpu"), 0)(logits, md).sampled_token_ids.tolist()
    assert out[1] == EOS  # two outputs already: free to stop
    assert out[0] not in (EOS, 11)
    assert out[2] == EOS  # ignore_eos: EOS is no stop token, so min_tokens leaves it alone


def test_unset_proto_fields_mean_off() -> None:
    md = metadata([wire_pb.SamplingParams(temperature=1.0)])  # top_p 0, rep penalty 0: unset
    assert md.top_p is None and md.top_k is None and md.min_p is None
    assert not md.needs_processing and md.logprob_rows is None
    np.testing.assert_array_equal(md.temperature.numpy(), [1.0])
