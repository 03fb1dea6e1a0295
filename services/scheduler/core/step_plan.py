"""What one schedule() call has decided so far, and the budgets it still has."""

from __future__ import annotations

from services.scheduler.core.request import Request


class StepPlan:
    """What one schedule() call decided so far. Dicts keep scheduling order and let a
    preemption undo a request's share of this step in O(1)."""

    __slots__ = ("token_budget", "prefill_cap", "num_prefill_tokens", "new_reqs",
                 "running_reqs", "prefill_reqs", "new_block_ids", "num_preempted")

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        """Tokens the step may still take, decodes and prompt chunks together."""
        self.prefill_cap = token_budget
        """Prompt tokens it may still take (lowered beside decodes: max_itl_factor)."""
        self.num_prefill_tokens = 0
        self.new_reqs: dict[Request, int] = {}       # request -> tokens this step
        self.running_reqs: dict[Request, int] = {}
        self.prefill_reqs: set[Request] = set()      # those of them running prompt chunks
        self.new_block_ids: dict[Request, list[int]] = {}
        self.num_preempted = 0

    @property
    def prefill_budget(self) -> int:
        return min(self.token_budget, self.prefill_cap)

    def prefill_chunk(self, num_new_tokens: int, threshold: int) -> int:
        """A prompt's next chunk: at most `threshold` tokens (long_prefill_token_threshold,
        0: no cap) and what the step's prefill budget leaves."""
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return min(num_new_tokens, self.prefill_budget)

    def take_prefill(self, request: Request, num_tokens: int) -> None:
        """Counts a request's tokens, scheduled already, as a prompt chunk."""
        self.prefill_reqs.add(request)
        self.prefill_cap -= num_tokens
        self.num_prefill_tokens += num_tokens

    def unschedule(self, request: Request) -> None:
        """Gives back a preempted request's share of the step."""
        for scheduled in (self.running_reqs, self.new_reqs):
            if request in scheduled:
                num_tokens = scheduled.pop(request)
                self.token_budget += num_tokens
                if request in self.prefill_reqs:
                    self.prefill_reqs.discard(request)
                    self.prefill_cap += num_tokens
                    self.num_prefill_tokens -= num_tokens
        self.new_block_ids.pop(request, None)
