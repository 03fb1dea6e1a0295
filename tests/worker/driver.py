"""A tiny in-test scheduler that drives a ModelRunner with StepInput messages.

It does what the real scheduler does, minimally: a token budget per step (a prompt longer than
what is left is chunked), decodes first, blocks handed out as requests grow (new blocks reach the
worker as cached_new_block_ids), requests finished after EOS or max_new_tokens, an optional
shared prefix whose full blocks a new request reuses (prefix caching), a deferred request's
last position scheduled again (its grammar was still compiling), and a decode's drafts
(speculative decoding) scheduled with it, its computed tokens rolled back past the rejected.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import betterproto
import numpy as np
from google.protobuf.message import Message as PbMessage

from services.common import wire, wire_pb
from services.common.packing import pack_int32, unpack_float32, unpack_int32
from services.worker.runner.model_runner import ModelRunner

Pb = TypeVar("Pb", bound=PbMessage)


def as_pb(message: betterproto.Message | Pb, pb_type: type[Pb]) -> Pb:
    """The runner's upb message for one a test built with betterproto (the same bytes)."""
    return message if isinstance(message, pb_type) else pb_type.FromString(bytes(message))


@dataclass
class DriverRequest:
    handle: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    sampling: wire.SamplingParams
    stop_at_eos: bool
    eos: tuple[int, ...]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    blocks_sent: int = 0
    logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, float]] = field(default_factory=list)
    prompt_logprobs_done: bool = False
    num_drafts: int = 0               # drafts the worker holds for the next step
    num_verified: int = 0             # drafts verified so far
    num_accepted: int = 0
    lora: wire.LoraRequest | None = None   # the adapter it runs with; None: the base model
    mm_items: list[wire.MultiModalItem] = field(default_factory=list)   # its images

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens or (
            self.stop_at_eos and bool(self.output_ids) and self.output_ids[-1] in self.eos)


class StepDriver:
    def __init__(self, runner: ModelRunner, token_budget: int = 1 << 30):
        self.runner = runner
        self.block_size = runner.info.block_size
        self.token_budget = token_budget
        self.requests: dict[int, DriverRequest] = {}
        self.free_blocks = list(range(runner.info.num_blocks - 1, 0, -1))  # block 0: null
        self.step = 0
        self.finished: list[int] = []

    def add(self, prompt_ids: list[int], max_new_tokens: int = 32,
            sampling: wire.SamplingParams | None = None, stop_at_eos: bool = True,
            prefix_of: int | None = None, num_prefix_blocks: int = 0,
            lora: wire.LoraRequest | None = None,
            mm_items: list[wire.MultiModalItem] | None = None) -> int:
        """Queues a request; with prefix_of, its first blocks are that request's (cached)."""
        handle = len(self.requests) + 1000
        req = DriverRequest(handle, list(prompt_ids), len(prompt_ids), max_new_tokens,
                            sampling or wire.SamplingParams(), stop_at_eos,
                            tuple(self.runner.info.eos_token_ids), lora=lora,
                            mm_items=list(mm_items or []))
        if prefix_of is not None:
            req.blocks = self.requests[prefix_of].blocks[:num_prefix_blocks]
            req.num_computed = num_prefix_blocks * self.block_size
        self.requests[handle] = req
        return handle

    def run(self) -> dict[int, list[int]]:
        """Steps until every request is done; returns each request's output ids."""
        while any(not r.done for r in self.requests.values()):
            self.run_step()
        self.run_step()  # sends the last finished handles
        return {h: r.output_ids for h, r in self.requests.items()}

    def run_drafting(self) -> Iterator[tuple[list[int], list[int]]]:
        """Steps until every request is done; after each step, yields every row that drafted:
        its known tokens and the drafts proposed for its next step."""
        batch = self.runner.input_batch
        while any(not r.done for r in self.requests.values()):
            self.run_step()
            for row in batch.handle_to_row.values():
                num_tokens = int(batch.num_tokens[row])
                if num_drafts := int(batch.num_draft_tokens[row]):
                    yield (batch.token_ids[row, :num_tokens].tolist(),
                           batch.token_ids[row, num_tokens:num_tokens + num_drafts].tolist())

    def run_step(self) -> wire_pb.StepOutput:
        new, new_sched, cached, cached_sched, cached_new_blocks = [], [], [], [], []
        budget = self.token_budget
        active = [r for r in self.requests.values() if not r.done and r.handle not in
                  self.finished]
        # NOTE: running decodes first, then prefills (continuing ones before new ones).
        active.sort(key=lambda r: (len(r.token_ids) - r.num_computed > 1, not r.sent))
        for req in active:
            num = min(len(req.token_ids) - req.num_computed, budget)
            if num == 1 and req.sent:
                room = req.max_new_tokens - len(req.output_ids) - 1
                num += max(0, min(req.num_drafts, budget - 1, room))
            if num <= 0:
                continue
            budget -= num
            self._grow_blocks(req, req.num_computed + num)
            if not req.sent:
                new.append(wire_pb.NewRequestData(
                    handle=req.handle, request_id=str(req.handle),
                    token_ids=pack_int32(req.token_ids), num_prompt_tokens=req.num_prompt_tokens,
                    block_ids=pack_int32(req.blocks), num_computed_tokens=req.num_computed,
                    sampling=as_pb(req.sampling, wire_pb.SamplingParams),
                    lora=None if req.lora is None else as_pb(req.lora, wire_pb.LoraRequest),
                    mm_items=[as_pb(item, wire_pb.MultiModalItem) for item in req.mm_items]))
                new_sched.append(num)
                req.sent = True
            else:
                cached.append(req)
                cached_sched.append(num)
                cached_new_blocks.append(req.blocks[req.blocks_sent:])
            req.blocks_sent = len(req.blocks)
        finished, self.finished = self.finished, []
        step = wire_pb.StepInput(
            step=self.step, new_requests=new,
            cached_handles=pack_int32([r.handle for r in cached]),
            cached_num_new_blocks=pack_int32([len(b) for b in cached_new_blocks]),
            cached_new_block_ids=pack_int32([b for bl in cached_new_blocks for b in bl]),
            cached_num_computed_tokens=pack_int32([r.num_computed for r in cached]),
            num_scheduled_tokens=pack_int32(new_sched + cached_sched),
            finished_handles=pack_int32(finished))
        self.step += 1
        out = self.runner.execute(step)
        assert not out.error, out.error
        scheduled = [self.requests[n.handle] for n in new] + cached
        num_known = {req.handle: len(req.token_ids) for req in scheduled}
        for req, num in zip(scheduled, new_sched + cached_sched):
            req.num_computed += num
        self._collect(out)
        for req in scheduled:
            num_drafts = req.num_computed - num_known[req.handle]
            if num_drafts > 0:   # verified drafts: keep the computed tokens accepted
                num_sampled = len(req.token_ids) - num_known[req.handle]
                req.num_verified += num_drafts
                req.num_accepted += num_sampled - 1
                req.num_computed -= num_drafts + 1 - num_sampled
        return out

    def _grow_blocks(self, req: DriverRequest, num_tokens: int) -> None:
        while len(req.blocks) * self.block_size < num_tokens:
            req.blocks.append(self.free_blocks.pop())

    def _collect(self, out: wire_pb.StepOutput) -> None:
        handles = unpack_int32(out.handles).tolist()
        drafts = dict(zip(unpack_int32(out.draft_handles).tolist(),
                          unpack_int32(out.num_draft_tokens).tolist()))
        for handle in handles:
            self.requests[handle].num_drafts = drafts.get(handle, 0)
        for handle in unpack_int32(out.deferred_handles).tolist():
            self.requests[handle].num_computed -= 1   # its grammar compiles: sample again
        for handle, token in zip(handles, unpack_int32(out.sampled_token_ids).tolist()):
            req = self.requests[handle]
            if req.done:
                continue   # tokens sampled past the request's end (verified drafts)
            req.token_ids.append(token)
            if req.done:
                self.finished.append(handle)
        if out.logprob_handles:
            cols = out.logprobs
            ids, lps = unpack_int32(cols.token_ids), unpack_float32(cols.logprobs)
            top_ids = unpack_int32(cols.top_token_ids).reshape(len(ids), cols.num_top)
            top_lps = unpack_float32(cols.top_logprobs).reshape(len(ids), cols.num_top)
            for i, handle in enumerate(unpack_int32(out.logprob_handles).tolist()):
                self.requests[handle].logprobs.append(
                    (int(ids[i]), float(lps[i]), top_ids[i].tolist(), top_lps[i].tolist()))
        for chunk in out.prompt_logprobs:
            req = self.requests[chunk.handle]
            ids = unpack_int32(chunk.columns.token_ids)
            lps = unpack_float32(chunk.columns.logprobs)
            req.prompt_logprobs.extend(zip(ids.tolist(), lps.tolist()))
            req.prompt_logprobs_done = chunk.is_last_chunk


def new_request_data(handle: int, prompt_ids: list[int] | np.ndarray, blocks: list[int],
                     sampling: wire.SamplingParams | wire_pb.SamplingParams | None = None,
                     num_computed: int = 0) -> wire_pb.NewRequestData:
    return wire_pb.NewRequestData(
        handle=handle, request_id=str(handle), token_ids=pack_int32(prompt_ids),
        num_prompt_tokens=len(prompt_ids), block_ids=pack_int32(blocks),
        num_computed_tokens=num_computed,
        sampling=as_pb(sampling or wire_pb.SamplingParams(), wire_pb.SamplingParams))
