"""Test doubles for the engine core: a fake worker with a paged 'KV cache' of token ids (and
one of a hybrid model, with a recurrent state per row), a manual clock, reference generation,
and block-pool invariant checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scheduler.core import (EngineCoreOutput, Request, RunnerOutput, Scheduler,
                                     SchedulerConfig, SchedulerOutput)
from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.output import StateCheckpointOps

NextToken = Callable[[Sequence[int]], int]


def next_token(context: Sequence[int]) -> int:
    """A deterministic 'greedy model': the next token depends on the whole context."""
    return (sum(context[-5:]) * 31 + len(context) * 7) % 50 + 10


def reference_output(prompt: Sequence[int], max_tokens: int,
                     model: NextToken = next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model(tokens))
    return tokens[len(prompt):]


def prompt(length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of `length` tokens; seeds give different ones."""
    return [(seed * 7 + i * 3) % 50 + 10 for i in range(length)]


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 0.01) -> None:
        self.now += seconds


@dataclass
class _Row:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeWorker:
    """Plays the worker's side of the per-step diff protocol. Its KV cache stores the token at
    each slot; it samples by reading the whole context back through the block table, so a
    wrong block table, a wrong prefix hit or a lost diff changes the output (or asserts)."""

    num_blocks: int
    block_size: int
    model: NextToken = next_token
    rows: dict[int, _Row] = field(default_factory=dict)
    num_deferrals: dict[int, int] = field(default_factory=dict)
    """Handle -> how many sampling steps it is deferred (its grammar still compiling): no
    token, and its last position uncounted, as the worker does."""

    def __post_init__(self) -> None:
        self.kv: list[list[int | None]] = [[None] * self.block_size
                                           for _ in range(self.num_blocks)]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.apply_diffs(out)
        scheduled = list(zip(out.scheduled_handles, out.num_scheduled_tokens))
        # Write every scheduled token's KV first, then attend (as each layer does).
        for handle, num_tokens in scheduled:
            row = self.rows[handle]
            start = row.num_computed_tokens
            assert start + num_tokens <= len(row.token_ids), "scheduled past the known tokens"
            for pos in range(start, start + num_tokens):
                self.kv[row.block_ids[pos // self.block_size]][pos % self.block_size] = \
                    row.token_ids[pos]
            row.num_computed_tokens += num_tokens
        handles, sampled, deferred = [], [], set()
        for handle, _ in scheduled:
            row = self.rows[handle]
            if row.num_computed_tokens < len(row.token_ids):
                continue
            if self.num_deferrals.get(handle, 0) > 0:
                self.num_deferrals[handle] -= 1
                row.num_computed_tokens -= 1
                deferred.add(handle)
                continue
            context = self.context(handle, row.num_computed_tokens)
            assert context == row.token_ids, f"KV of handle {handle} does not match its tokens"
            token = self.model(context)
            row.token_ids.append(token)
            handles.append(handle)
            sampled.append(token)
        return RunnerOutput(handles, sampled, deferred=deferred)

    def apply_diffs(self, out: SchedulerOutput) -> None:
        """Finished rows dropped, new rows added, cached rows' block tables grown."""
        for handle in out.finished_handles:
            self.rows.pop(handle, None)
        for new in out.new_requests:
            assert new.handle not in self.rows, f"handle {new.handle} already has a row"
            assert 0 not in new.block_ids, "the null block was handed out"
            self.rows[new.handle] = _Row(list(new.token_ids), list(new.block_ids),
                                         new.num_computed_tokens)
        cached = out.cached
        for i, handle in enumerate(cached.handles):
            row = self.rows[handle]
            assert row.num_computed_tokens == cached.num_computed_tokens[i]
            assert 0 not in cached.new_block_ids[i]
            row.block_ids.extend(cached.new_block_ids[i])

    def context(self, handle: int, num_tokens: int) -> list[int]:
        """The first `num_tokens` tokens of a row, read back from the KV cache."""
        row = self.rows[handle]
        return [self.kv[row.block_ids[p // self.block_size]][p % self.block_size]
                for p in range(num_tokens)]


@dataclass
class FakeHybridWorker(FakeWorker):
    """FakeWorker with a recurrent state per row (the tokens it took) and checkpoint slots:
    a row must start from exactly its computed prefix, restored or empty."""

    states: dict[int, list[int]] = field(default_factory=dict)
    checkpoints: dict[int, list[int]] = field(default_factory=dict)
    num_restores: int = 0

    def apply_diffs(self, out: SchedulerOutput) -> None:
        super().apply_diffs(out)
        ops = out.state_checkpoints or StateCheckpointOps()
        restores = dict(zip(ops.restore_handles, ops.restore_slots))
        for new in out.new_requests:
            slot = restores.get(new.handle)
            self.states[new.handle] = [] if slot is None else list(self.checkpoints[slot])
            self.num_restores += slot is not None
        for handle in out.scheduled_handles:
            row = self.rows[handle]
            assert self.states[handle] == row.token_ids[:row.num_computed_tokens], (
                f"handle {handle} continues from a state it never took")

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = super().execute(out)
        for handle in out.scheduled_handles:
            row = self.rows[handle]
            self.states[handle] = row.token_ids[:row.num_computed_tokens]
        ops = out.state_checkpoints or StateCheckpointOps()
        for handle, slot in zip(ops.save_handles, ops.save_slots):
            self.checkpoints[slot] = list(self.states[handle])
        return result


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, EngineCoreOutput] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None
    """Async scheduling: the step the worker ran whose results the scheduler has not seen."""


def make_scheduler(num_blocks: int = 64, clock: ManualClock | None = None,
                   **config) -> tuple[Scheduler, FakeWorker]:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 256)
    # What these tests were written against (the product runs 128, priority, async: those
    # have tests of their own).
    config.setdefault("max_num_batched_tokens", 512)
    config.setdefault("policy", "fcfs")
    config.setdefault("async_scheduling", False)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=num_blocks, **config),
                          clock=clock or ManualClock())
    # A hybrid model's worker: a recurrent state per row, restored only from checkpoints.
    worker_type = FakeHybridWorker if config.get("num_state_checkpoints") else FakeWorker
    return scheduler, worker_type(num_blocks, config["block_size"])


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int = 8,
                 arrival_time: float = 0.0, **kwargs) -> Request:
    return Request(request_id, list(prompt), max_tokens=max_tokens, arrival_time=arrival_time,
                   **kwargs)


def step(scheduler: Scheduler, worker: FakeWorker, run: Run) -> SchedulerOutput:
    """One engine step with the checks every step must pass. With async scheduling the
    worker runs this step before the scheduler sees the previous one's results, as the
    service overlaps them."""
    out = scheduler.schedule()
    config = scheduler.config
    assert sum(out.num_scheduled_tokens) == out.total_num_scheduled_tokens
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(n > 0 for n in out.num_scheduled_tokens)
    assert len(out.num_scheduled_tokens) <= config.max_num_seqs
    assert len(set(out.scheduled_handles)) == len(out.scheduled_handles)
    run.steps.append(out)
    ran = (out, worker.execute(out))
    if config.async_scheduling:
        ran, run.in_flight = run.in_flight, ran
    if ran is not None:
        _update(scheduler, run, *ran)
    return out


def finish_in_flight(scheduler: Scheduler, run: Run) -> None:
    """Async scheduling: the scheduler takes the last step's results."""
    if run.in_flight is not None:
        ran, run.in_flight = run.in_flight, None
        _update(scheduler, run, *ran)


def _update(scheduler: Scheduler, run: Run, out: SchedulerOutput,
            runner_output: RunnerOutput) -> None:
    for result in scheduler.update_from_output(out, runner_output):
        run.outputs.setdefault(result.request_id, []).extend(result.new_token_ids)
        if result.finish_reason is not None:
            run.finished[result.request_id] = result
    check_kv_cache_manager(scheduler.kv_cache_manager)


def run_until_done(scheduler: Scheduler, worker: FakeWorker, run: Run | None = None,
                   max_steps: int = 5000) -> Run:
    run = run or Run()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, worker, run)
    finish_in_flight(scheduler, run)
    assert not scheduler.has_unfinished_requests(), "requests did not finish"
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks, "blocks leaked"
    return run


def assert_matches_reference(run: Run, requests: dict[str, tuple[list[int], int]]) -> None:
    """Each request's output is the plain greedy reference's for its prompt."""
    for request_id, (tokens, max_tokens) in requests.items():
        assert run.outputs[request_id] == reference_output(tokens, max_tokens), request_id


def check_kv_cache_manager(manager: KVCacheManager) -> None:
    """The pool's invariants: every block is free xor referenced; ref counts equal block-table
    references; the free queue is a consistent list; the hash map and the blocks agree."""
    pool = manager.block_pool
    null = pool.null_block
    assert null.block_id == 0 and null.ref_cnt == 0 and null.block_hash is None
    assert null.prev_free_block is None and null.next_free_block is None
    references = Counter(block.block_id for table in manager.req_to_blocks.values()
                         for block in table)
    assert 0 not in references
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.free_block_queue.num_free_blocks
    free_ids = {block.block_id for block in free}
    assert len(free_ids) == len(free)
    previous = pool.free_block_queue._head
    for block in free:
        assert block.prev_free_block is previous
        previous = block
    for block in pool.blocks[1:]:
        assert block.ref_cnt == references.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
        if block.block_id not in free_ids:
            assert block.prev_free_block is None and block.next_free_block is None
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block[block.block_hash] is block
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for table in manager.req_to_blocks.values():
        assert len({block.block_id for block in table}) == len(table)
