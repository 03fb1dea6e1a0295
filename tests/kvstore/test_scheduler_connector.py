"""The engine core with the KV connector, against a fake worker and a fake store: loaded
prefixes give the output a cold run gives, a failed load recomputes (or fails, per policy),
aborts and a lost worker leave no loads behind, a producer's finish waits for its saves, and
blocks evicted from the pool are saved before they are overwritten."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core import Request, RunnerOutput, Scheduler, SchedulerConfig
from services.scheduler.core.kv_connector.connector import SchedulerKVConnector
from services.scheduler.core.kv_connector.metadata import (
    KVConnectorOutput,
    KVRole,
    LoadFailurePolicy,
    SaveMode,
)
from services.scheduler.core.request import RequestStatus
from tests.scheduler.fakes import (
    FakeWorker,
    ManualClock,
    Run,
    check_kv_cache_manager,
    make_request,
    reference_output,
    run_until_done,
    step,
)

BLOCK = 4
PROMPT = list(range(100, 141))   # 41 tokens: 10 full blocks, the last one is never loaded


@dataclass
class FakeKVWorker(FakeWorker):
    """Moves blocks between its 'KV' (token ids per slot) and a shared store dict. A load
    reports `load_limit` blocks at most (then failed), mimicking a damaged or missing block."""

    store: dict[bytes, list[int | None]] = field(default_factory=dict)
    load_limit: int | None = None
    hold_saves: bool = False
    saves_seen: list = field(default_factory=list)
    pending: KVConnectorOutput = field(default_factory=KVConnectorOutput)

    def execute(self, out):  # type: ignore[override]
        for new in out.new_requests:   # the real worker refuses more blocks than tokens need
            assert len(new.block_ids) == -(-(len(new.token_ids) + 1) // BLOCK) or \
                len(new.block_ids) == -(-len(new.token_ids) // BLOCK), new
        meta = out.kv_connector_metadata
        report, self.pending = self.pending, KVConnectorOutput()
        if meta is not None:
            for save in meta.saves:
                if save.before_forward:
                    self._save(save, report)
        runner_output = super().execute(out)
        if meta is not None:
            for save in meta.saves:
                if not save.before_forward:
                    self._save(save, report)
            for load in meta.loads:
                limit = len(load.block_ids) if self.load_limit is None else self.load_limit
                num_ok = 0
                for block_id, block_hash in zip(load.block_ids, load.block_hashes):
                    if num_ok == limit or block_hash not in self.store:
                        break
                    self.kv[block_id] = list(self.store[block_hash])
                    num_ok += 1
                report.loaded.append((load.handle, num_ok, num_ok < len(load.block_ids)))
        return RunnerOutput(runner_output.handles, runner_output.sampled_token_ids, report)

    def _save(self, save, report: KVConnectorOutput) -> None:
        self.saves_seen.append(save)
        for block_id, block_hash in zip(save.block_ids, save.block_hashes):
            self.store[block_hash] = list(self.kv[block_id])
        (self.pending if self.hold_saves else report).saved.append((save.save_id, True))


def make_engine(store: dict, num_blocks: int = 64, role: KVRole = KVRole.BOTH,
                policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE,
                save_mode: SaveMode = SaveMode.WRITE_THROUGH,
                **config) -> tuple[Scheduler, FakeKVWorker, SchedulerKVConnector]:
    connector = SchedulerKVConnector(BLOCK, role, save_mode, policy, lambda: ["node:1"])
    config.setdefault("max_num_batched_tokens", 512)   # what these tests were written against
    config.setdefault("async_scheduling", False)
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=num_blocks, block_size=BLOCK,
                                          max_model_len=256, policy="fcfs", **config),
                          clock=ManualClock(), kv_connector=connector)
    return scheduler, FakeKVWorker(num_blocks, BLOCK, store=store), connector


def admit(scheduler: Scheduler, store: dict, request: Request) -> Request:
    """The service's lookup, against the fake store: the leading blocks it holds."""
    scheduler.add_request(request)
    for block_hash in request.block_hashes:
        if block_hash not in store:
            break
        request.kv_store_hit.append("node:1")
    return request


def test_a_prefix_computed_on_one_engine_is_loaded_on_another() -> None:
    store: dict = {}
    engine_a, worker_a, _ = make_engine(store)
    engine_a.add_request(make_request("a", PROMPT, max_tokens=6))
    run_a = run_until_done(engine_a, worker_a)
    assert len(store) == 10   # every full prompt block was written through
    engine_b, worker_b, connector_b = make_engine(store)
    request = admit(engine_b, store, make_request("b", PROMPT, max_tokens=6))
    run_b = Run()
    first = step(engine_b, worker_b, run_b)   # the load: no tokens run meanwhile
    assert first.is_empty and first.kv_connector_metadata.loads
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 40
    run_until_done(engine_b, worker_b, run_b)
    assert run_b.outputs["b"] == run_a.outputs["a"] == reference_output(PROMPT, 6)
    new = next(s.new_requests[0] for s in run_b.steps if s.new_requests)
    assert new.num_computed_tokens == 40   # 10 blocks loaded, only the last token computed
    assert connector_b.num_hit_tokens == 40 and connector_b.num_load_failures == 0
    assert run_b.finished["b"].num_cached_tokens == 40


def test_a_damaged_load_recomputes_the_rest_or_fails_per_policy() -> None:
    store: dict = {}
    engine, worker, _ = make_engine(store)
    engine.add_request(make_request("a", PROMPT, max_tokens=5))
    run_until_done(engine, worker)
    engine, worker, connector = make_engine(store)
    worker.load_limit = 3
    admit(engine, store, make_request("b", PROMPT, max_tokens=5))
    run = run_until_done(engine, worker)
    assert run.outputs["b"] == reference_output(PROMPT, 5)
    assert connector.num_hit_tokens == 12 and connector.num_load_failures == 1
    engine, worker, _ = make_engine(store, policy=LoadFailurePolicy.FAIL)
    worker.load_limit = 3
    admit(engine, store, make_request("c", PROMPT, max_tokens=5))
    admit(engine, store, make_request("d", [7, 8, 9], max_tokens=5))   # keeps running
    run = run_until_done(engine, worker)
    assert run.finished["c"].finish_reason is not None and run.outputs.get("c", []) == []
    assert str(run.finished["c"].finish_reason) == "error"
    assert run.outputs["d"] == reference_output([7, 8, 9], 5)


def test_abort_and_worker_loss_while_loading_leave_nothing_behind() -> None:
    store: dict = {}
    engine, worker, _ = make_engine(store)
    engine.add_request(make_request("a", PROMPT, max_tokens=2))
    run_until_done(engine, worker)
    engine, worker, connector = make_engine(store)
    request = admit(engine, store, make_request("b", PROMPT, max_tokens=2))
    engine.schedule()   # the load starts; the worker never answers it
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_requests(["b"])
    assert request.handle in engine.schedule().finished_handles   # the worker cancels it
    assert not connector.has_work and not engine.has_unfinished_requests()
    check_kv_cache_manager(engine.kv_cache_manager)
    # A worker lost mid-load: the request starts afresh and still gives the right output.
    request = admit(engine, store, make_request("c", PROMPT, max_tokens=4))
    engine.schedule()
    engine.preempt_all()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    worker.rows.clear()
    run = run_until_done(engine, worker)
    assert run.outputs["c"] == reference_output(PROMPT, 4)


def test_a_producer_finishes_only_once_its_prompt_is_stored() -> None:
    store: dict = {}
    engine, worker, connector = make_engine(store, role=KVRole.PRODUCER)
    worker.hold_saves = True   # the store acknowledges each save one step late
    admit(engine, store, make_request("p", PROMPT, max_tokens=1, do_remote_decode=True))
    finished_at = sent_at = None
    for index in range(20):
        if not engine.has_unfinished_requests() and not connector.has_work:
            break
        out = engine.schedule()
        outputs = engine.update_from_output(out, worker.execute(out))
        if any(o.finished for o in outputs):
            finished_at = index
        if any(o.finished for o in connector.hold_finished(outputs)):
            sent_at = index
            assert all(h in store for h in engine.block_hasher.hash_blocks(PROMPT))
    assert finished_at is not None and sent_at == finished_at + 1


def test_on_evict_saves_blocks_before_the_pool_reuses_them() -> None:
    store: dict = {}
    engine, worker, _ = make_engine(store, num_blocks=14, save_mode=SaveMode.ON_EVICT)
    engine.add_request(make_request("a", PROMPT, max_tokens=2))
    run_until_done(engine, worker)
    assert not store   # nothing saved while the blocks are still in the pool
    engine.add_request(make_request("b", list(range(500, 541)), max_tokens=2))
    run_until_done(engine, worker)
    evicted = [s for s in worker.saves_seen if s.before_forward]
    assert evicted and all(h in store for s in evicted for h in s.block_hashes)
    hashes = engine.block_hasher.hash_blocks(PROMPT)
    assert [store[h] for h in hashes if h in store] == [
        PROMPT[i * BLOCK:(i + 1) * BLOCK] for i, h in enumerate(hashes) if h in store]


def test_on_reuse_saves_a_prefix_when_a_later_request_hits_it_once() -> None:
    store: dict = {}
    engine, worker, connector = make_engine(store, save_mode=SaveMode.ON_REUSE)
    engine.add_request(make_request("a", PROMPT, max_tokens=2))
    run_until_done(engine, worker)
    assert not store   # seen once: not saved
    hashes = engine.block_hasher.hash_blocks(PROMPT)
    # Reused: the 10 full blocks the second request hits are saved, with their content.
    engine.add_request(make_request("b", PROMPT + [1, 2, 3, 4, 5], max_tokens=2))
    run = run_until_done(engine, worker)
    assert run.outputs["b"] == reference_output(PROMPT + [1, 2, 3, 4, 5], 2)
    assert sorted(store) == sorted(hashes)
    assert [store[h] for h in hashes] == [PROMPT[i * BLOCK:(i + 1) * BLOCK] for i in range(10)]
    connector.hold_finished([])   # the service reads the worker's save reports
    assert connector.num_saved_blocks == 10
    # Reused again: nothing new to save.
    engine.add_request(make_request("c", PROMPT, max_tokens=2))
    run_until_done(engine, worker)
    connector.hold_finished([])
    assert len(worker.saves_seen) == 1 and connector.num_saved_blocks == 10


def test_on_reuse_saves_again_what_a_failed_save_lost() -> None:
    store: dict = {}
    engine, worker, connector = make_engine(store, save_mode=SaveMode.ON_REUSE)
    for request_id in ("a", "b"):
        engine.add_request(make_request(request_id, PROMPT, max_tokens=2))
        out = engine.schedule()
        runner_output = worker.execute(out)
        runner_output.kv_connector_output.saved = [
            (save_id, False) for save_id, _ in runner_output.kv_connector_output.saved]
        engine.update_from_output(out, runner_output)
        connector.hold_finished([])
        run_until_done(engine, worker)
    assert connector.num_save_failures == 1 and connector.num_saved_blocks == 0
    engine.add_request(make_request("c", PROMPT, max_tokens=2))
    run_until_done(engine, worker)
    connector.hold_finished([])
    assert connector.num_saved_blocks == 10 and len(worker.saves_seen) == 2
