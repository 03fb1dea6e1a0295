"""How a step moves a request's token counts, for steps built ahead of results.

A step counts its tokens as computed when it is built, and a request that reaches its end
in it samples there: it holds a placeholder for that token until the step's result is back
(`Request.num_output_placeholders`). Without async scheduling the result is back before the
next step is built, so placeholders are 0 between steps. With it, the next step is built
while this one runs: the worker runs steps in order and keeps each row's sampled tokens, so
a decode may be scheduled for the position after its placeholder.
"""

from __future__ import annotations

from services.scheduler.core.output import SchedulerOutput
from services.scheduler.core.request import Request


def advance(output: SchedulerOutput) -> None:
    """Counts the step's tokens as computed; each request that samples in it gets a
    placeholder and is named in `sampling_handles`."""
    sampling = output.sampling_handles
    for request, num_tokens in zip(output.scheduled_requests, output.num_scheduled_tokens):
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            sampling.add(request.handle)


def may_run_ahead(request: Request, max_model_len: int) -> bool:
    """Whether a request whose sampled token is still in flight runs the position after it
    now. Not when that token may end it (max_tokens, the model's length), nor while its
    worker row may still defer sampling for its grammar (the worker would then hold no token
    for that position); a stop token is seen too late, and that one step is wasted."""
    placeholders = request.num_output_placeholders
    if (len(request.output_token_ids) + placeholders >= request.max_tokens
            or request.num_tokens + placeholders >= max_model_len):
        return False
    return not request.has_grammar or (request.worker_sampled
                                       and not request.grammar_after_reasoning)


def forget_worker_row(request: Request) -> None:
    """The request lost its worker row (preempted): it recomputes from scratch, and whatever
    its steps in flight return is dropped."""
    request.num_computed_tokens = 0
    request.num_output_placeholders = 0
    request.num_spec_tokens = 0          # its worker row, with the drafts, goes
    request.worker_sampled = False
