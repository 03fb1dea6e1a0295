"""The sampler: one batched pass over the sampling rows' logits (vLLM V1's order of operations).

0. structured outputs: the grammar bitmask of the constrained rows, applied once over the
   batch; everything after (logprobs included, as in vLLM) sees the masked logits.
1. logprobs, if asked: log_softmax of the raw model logits. NOTE: this is vLLM's default
   logprobs mode ("raw_logprobs"): what the model predicted, before penalties, logit_bias,
   temperature and top-k/top-p/min-p.
2. logits processing: logit_bias, min_tokens (stop tokens banned until enough outputs), then
   repetition / presence / frequency penalties. These change greedy results too.
3. greedy rows: argmax. An all-greedy batch without processing is only this step.
4. random rows: temperature, then min-p, top-k, top-p, then inverse-CDF sampling: one uniform
   per row picks a token from the cumulative distribution. A seeded request draws its uniform
   from its own torch.Generator, so its tokens do not depend on the batch around it; unseeded
   rows share one generator.
No Python loop touches the vocabulary; the only per-row loop is over seeded rows (one RNG call).

NOTE (CPU costs, 32 rows x 49k vocab, one core): a full sort ~95 ms, exponential noise for an
exponential race ~30 ms, a bool-mask masked_fill ~7 ms, topk(1024) ~11 ms, softmax or cumsum
~1 ms. So with top-k/top-p the work happens on the top candidates only (candidate_probs), and
sampling draws one uniform per row instead of a noise value per token. Rows whose nucleus or
min-p set reaches beyond the candidates are computed again over the whole (sorted) row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampling.sampling_metadata import SamplingMetadata
from services.worker.sampling.structured_outputs import apply_bitmask

NUCLEUS_CANDIDATES = 1024  # candidates for rows with top-p but no top-k


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # int64 [N]
    # For md.logprob_rows only: the sampled token's logprob and the top alternatives.
    logprobs: torch.Tensor | None = None     # fp32 [M]
    top_token_ids: torch.Tensor | None = None  # int64 [M, max_num_logprobs]
    top_logprobs: torch.Tensor | None = None   # fp32 [M, max_num_logprobs]


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: fp32 [N, vocab], owned by the sampler (modified in place)."""
        if md.grammar_bitmask is not None:
            apply_bitmask(logits, md.grammar_bitmask)
        raw_logprobs = None
        if md.logprob_rows is not None:
            raw_logprobs = logits[md.logprob_rows].log_softmax(dim=-1)
        if md.needs_processing:
            apply_logits_processing(logits, md)
        sampled = greedy_sample(logits) if md.all_greedy else self._sample(logits, md)
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            token_ids = sampled[md.logprob_rows]
            out.logprobs, out.top_token_ids, out.top_logprobs = gather_logprobs(
                raw_logprobs, token_ids, md.max_num_logprobs)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = None if md.all_random else greedy_sample(logits)
        logits.div_(md.temperature.unsqueeze(1))
        uniforms = torch.rand(md.num_rows, generator=self.generator, device=logits.device)
        for row, generator in md.generators.items():
            uniforms[row] = torch.rand(1, generator=generator, device=logits.device)
        random = random_sample(logits, uniforms, md.top_k, md.top_p, md.min_p)
        return random if greedy is None else torch.where(md.is_greedy, greedy, random)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type == "cpu":
        # NOTE: numpy's argmax is ~10x faster than torch's on CPU (same first-max tie rule).
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def random_sample(logits: torch.Tensor, uniforms: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Token ids drawn from the temperature-scaled logits [N, V] under each row's masks.

    A row without top-k and top-p draws over the whole vocabulary in token-id order; a row
    with either draws in rank order (most likely first) over its candidates. Which of the two
    a row takes depends on its own parameters only, so a seeded row's token never depends on
    the batch around it.
    """
    num_rows = logits.shape[0]
    ranked = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        ranked |= top_k > 0
    if top_p is not None:
        ranked |= top_p < 1.0
    if not bool(ranked.any()):
        if min_p is not None:
            apply_min_p(logits, min_p)
        return inverse_cdf(logits.softmax(dim=-1), uniforms)
    if bool(ranked.all()):
        return _ranked_sample(logits, uniforms, top_k, top_p, min_p)
    sampled = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    for rows, fn in ((ranked.nonzero().squeeze(1), _ranked_sample),
                     ((~ranked).nonzero().squeeze(1), random_sample)):
        sampled[rows] = fn(logits[rows], uniforms[rows], _rows(top_k, rows), _rows(top_p, rows),
                           _rows(min_p, rows))
    return sampled


def _ranked_sample(logits: torch.Tensor, uniforms: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    token_ids, probs, exact = candidate_probs(logits, top_k, top_p, min_p)
    sampled = token_ids.gather(1, inverse_cdf(probs, uniforms).unsqueeze(1)).squeeze(1)
    if not bool(exact.all()):
        rows = (~exact).nonzero().squeeze(1)
        token_ids, probs, _ = candidate_probs(logits[rows], _rows(top_k, rows),
                                              _rows(top_p, rows), _rows(min_p, rows),
                                              num_candidates=logits.shape[1])
        sampled[rows] = token_ids.gather(1, inverse_cdf(probs, uniforms[rows]).unsqueeze(1)
                                         ).squeeze(1)
    return sampled


def _rows(values: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[rows]


def candidate_probs(logits: torch.Tensor, top_k: torch.Tensor | None,
                    top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                    num_candidates: int | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The min-p / top-k / top-p distribution over each row's most likely candidates.

    Top-k keeps the k most likely tokens (rank-based: of tokens tied at the k-th logit, the
    first k in rank order); min-p drops tokens below min_p x the top probability; top-p then
    keeps the smallest most-likely-first set whose probability (within what top-k and min-p
    left) reaches p. Returns (token ids [N, K] in rank order, unnormalized probabilities [N, K]
    with dropped tokens at 0, exact [N]). exact is False where a row's distribution reaches
    beyond the K candidates (a wide nucleus, or min-p keeping more than K tokens); with
    num_candidates = vocab size every row is exact.
    """
    num_rows, vocab_size = logits.shape
    k = top_k if top_k is not None else torch.zeros(num_rows, dtype=torch.long,
                                                    device=logits.device)
    no_top_k = k == 0
    if num_candidates is None:
        num_candidates = max(int(k.max()), NUCLEUS_CANDIDATES if bool(no_top_k.any()) else 0)
    num_candidates = min(num_candidates, vocab_size)
    values, token_ids = logits.topk(num_candidates, dim=-1)  # sorted, largest first
    ranks = torch.arange(num_candidates, device=logits.device)
    keep = ranks.unsqueeze(0) < torch.where(no_top_k, num_candidates, k).unsqueeze(1)
    # Whether every token that survives top-k and min-p is among the candidates.
    covered = ~no_top_k if num_candidates < vocab_size else torch.ones_like(no_top_k)
    if min_p is not None:
        threshold = values[:, :1] + min_p.log().unsqueeze(1)  # p < min_p * p_max, in logits
        keep &= values >= threshold
        covered |= values[:, -1] < threshold.squeeze(1)
    values = values.masked_fill(~keep, float("-inf"))
    log_norm = torch.logsumexp(values, dim=-1)
    # NOTE: an uncovered row without min-p keeps every token, so its normalizer is the whole
    # row's; with min-p it would need a full-row mask (that row is inexact, computed again).
    wide = ~covered
    if bool(wide.any()):
        log_norm = torch.where(wide, torch.logsumexp(logits, dim=-1), log_norm)
    probs = (values - log_norm.unsqueeze(1)).exp_()
    if top_p is None:
        return token_ids, probs, covered
    cumulative = probs.cumsum(dim=-1)
    probs = probs.masked_fill((cumulative - probs) >= top_p.unsqueeze(1), 0.0)
    closes = cumulative[:, -1] >= top_p  # the nucleus ends among the candidates
    if min_p is not None:
        closes &= min_p == 0
    return token_ids, probs, covered | closes


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of unnormalized probs [N, K] with uniforms [N] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # NOTE: kept strictly below the total, so rounding can never land on a zero-probability
    # tail entry (the first cdf entry above the target always has positive probability).
    target = torch.minimum(uniforms.unsqueeze(1) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def apply_logits_processing(logits: torch.Tensor, md: SamplingMetadata) -> None:
    if md.logit_bias is not None:
        rows, ids, values = md.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if md.banned is not None:
        logits.index_put_(md.banned, torch.tensor(float("-inf"), device=logits.device))
    if md.has_penalties:
        apply_penalties(logits, md)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """vLLM's definitions: repetition over prompt + output tokens (divide positive logits,
    multiply negative ones); frequency (x count) and presence (x seen) over output tokens."""
    num_rows, vocab_size = logits.shape
    output_counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype,
                                device=logits.device)
    output_counts.scatter_add_(1, md.output_token_ids, torch.ones_like(
        md.output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]
    in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, md.prompt_token_ids, True)
    in_output = output_counts > 0
    seen = in_prompt[:, :vocab_size] | in_output
    penalty = torch.where(seen, md.repetition_penalty.unsqueeze(1), 1.0)
    logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    logits.sub_(md.frequency_penalty.unsqueeze(1) * output_counts)
    logits.sub_(md.presence_penalty.unsqueeze(1) * in_output)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens whose probability is below min_p x the top token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of token_ids [M], top ids [M, num_top], top logprobs [M, num_top])."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_ids, top_logprobs
