"""A fake worker that speculates, for engine-core tests: it proposes drafts that are right
for a while and then wrong (on a fixed pattern), verifies them greedily against the fake
model by reading the context back through its paged 'KV cache', and rolls back rejected
positions as the real worker does."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core import Request, RunnerOutput, Scheduler, SchedulerOutput
from tests.scheduler.fakes import FakeWorker


def wrong(token: int) -> int:
    return token + 1000   # never a token the fake model produces


@dataclass
class SpecFakeWorker(FakeWorker):
    num_speculative_tokens: int = 3
    drafts: dict[int, list[int]] = field(default_factory=dict)
    num_proposals: int = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for handle in [*out.finished_handles, *(new.handle for new in out.new_requests)]:
            self.drafts.pop(handle, None)   # a dropped or (re)sent row has no drafts
        self.apply_diffs(out)
        scheduled = list(zip(out.scheduled_handles, out.num_scheduled_tokens))
        for handle, num_tokens in scheduled:
            row = self.rows[handle]
            known = row.token_ids + self.drafts.get(handle, [])
            start = row.num_computed_tokens
            assert start + num_tokens <= len(known), "scheduled past the tokens and drafts"
            for pos in range(start, start + num_tokens):
                self.kv[row.block_ids[pos // self.block_size]][pos % self.block_size] = known[pos]
            row.num_computed_tokens += num_tokens
        handles, sampled, spec = [], [], {}
        for handle, _ in scheduled:
            row = self.rows[handle]
            if row.num_computed_tokens < len(row.token_ids):
                continue
            drafts = self.drafts.pop(handle, [])[:row.num_computed_tokens - len(row.token_ids)]
            for draft in [*drafts, None]:
                context = self.context(handle, len(row.token_ids))
                assert context == row.token_ids, f"KV of handle {handle} does not match"
                token = self.model(context)
                row.token_ids.append(token)
                handles.append(handle)
                sampled.append(token)
                if token != draft:
                    break
            row.num_computed_tokens = len(row.token_ids) - 1   # rejected positions roll back
            spec[handle] = self._propose(row.token_ids)
            self.drafts[handle] = spec[handle]
        return RunnerOutput(handles, sampled,
                            num_spec_tokens={h: len(d) for h, d in spec.items() if d})

    def _propose(self, token_ids: list[int]) -> list[int]:
        """The model's true continuation, with every third proposal's later drafts wrong."""
        self.num_proposals += 1
        context, drafts = list(token_ids), []
        for j in range(self.num_speculative_tokens):
            token = self.model(context)
            if self.num_proposals % 3 == 0 and j >= 1:
                token = wrong(token)
            drafts.append(token)
            context.append(token)
        return drafts


def check_cached_blocks_hold_known_tokens(scheduler: Scheduler, worker: FakeWorker) -> None:
    """Every block in the prefix cache that a request holds stores exactly the tokens its
    hash names: no rejected draft was ever cached."""
    manager = scheduler.kv_cache_manager
    size = scheduler.block_size
    request: Request
    for request in scheduler.requests.values():
        for index, block in enumerate(manager.req_to_blocks.get(request.request_id, [])):
            if block.block_hash is None:
                continue
            assert block.block_hash == request.block_hashes[index]
            assert worker.kv[block.block_id] == request.all_token_ids[index * size:
                                                                      (index + 1) * size]
