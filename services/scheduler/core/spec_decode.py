"""Speculative decoding, the scheduler's share: how many drafts a step runs, and the rollback
and counts once the worker verified them.

The worker proposes drafts after sampling and keeps them; the scheduler learns only how many
(`request.num_spec_tokens`). A decode then asks for 1 + drafts tokens under the one token
budget, like a short prefill chunk: the budget, max_tokens and max_model_len trim the drafts,
never the decode's own token. After the step, `num_computed_tokens` keeps only the accepted
drafts (rejected positions hold KV of tokens the request never had; the next steps overwrite
them), and since block hashes cover only the request's known tokens, no block holding a
rejected draft is ever hashed into the prefix cache or saved to the kvstore.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core.request import Request


def num_drafts_to_schedule(request: Request, token_budget: int, max_model_len: int,
                           num_speculative_tokens: int) -> int:
    """Drafts a decode of `request` runs with its own token, within `token_budget` (which
    the decode's token fits) and without running past max_tokens or max_model_len (the
    step emits up to drafts + 1 tokens)."""
    return max(0, min(request.num_spec_tokens, num_speculative_tokens, token_budget - 1,
                      request.max_tokens - request.num_output_tokens - 1,
                      max_model_len - request.num_tokens - 1))


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative counts, as vLLM's spec_decode metrics define them."""

    num_drafts: int = 0
    """Steps in which a request verified at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    """Index j: drafts accepted at position j of their step (0 = the first draft)."""

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))


def apply_verification(request: Request, num_draft_tokens: int, num_sampled: int,
                       stats: SpecDecodingStats) -> None:
    """The worker verified `num_draft_tokens` drafts of `request` and sampled `num_sampled`
    tokens (the accepted drafts plus one): computed tokens roll back over the rejected
    ones."""
    num_accepted = num_sampled - 1
    request.num_computed_tokens -= num_draft_tokens - num_accepted
    request.num_draft_tokens += num_draft_tokens
    request.num_accepted_tokens += num_accepted
    stats.observe(num_draft_tokens, num_accepted)
