"""Property-based tests: random allocate / append / free / prefix-hit / evict / preempt
sequences against the block pool and KV cache manager, with the pool's invariants checked
after every step and a fake KV store proving that every prefix hit returns the right tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.block_hash import BlockHasher
from services.scheduler.core import Request
from services.scheduler.core.kv_cache_manager import KVCacheManager
from tests.scheduler.fakes import check_kv_cache_manager

BLOCK_SIZE = 4
NUM_BLOCKS = 16
# A few shared prefixes make prefix hits (and evictions of shared blocks) common.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]

SETTINGS = settings(max_examples=100, stateful_step_count=40, derandomize=True, database=None,
                    deadline=None, suppress_health_check=list(HealthCheck))


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, max_model_len=64,
                                      enable_caching=True)
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: dict[str, Request] = {}   # holds blocks
        self.waiting: dict[str, Request] = {}   # new or preempted: holds none
        self.kv: dict[int, dict[int, int]] = {}  # block id -> slot -> token (the fake KV)
        self.count = 0

    # ---- helpers ---------------------------------------------------------------------
    def _write_kv(self, request: Request, start: int, num_tokens: int) -> None:
        blocks = self.manager.req_to_blocks[request.request_id]
        for pos in range(start, start + num_tokens):
            block_id = blocks[pos // BLOCK_SIZE].block_id
            self.kv.setdefault(block_id, {})[pos % BLOCK_SIZE] = request.all_token_ids[pos]

    def _check_hit(self, request: Request, num_hit_tokens: int) -> None:
        blocks = self.manager.req_to_blocks[request.request_id]
        for pos in range(num_hit_tokens):
            stored = self.kv[blocks[pos // BLOCK_SIZE].block_id][pos % BLOCK_SIZE]
            assert stored == request.all_token_ids[pos], "a prefix hit returned other tokens"

    def _schedule(self, request: Request, chunk: int) -> bool:
        """Admits a waiting request (with its prefix hit) or extends a running one."""
        manager = self.manager
        is_new = request.request_id in self.waiting
        computed, num_hit = (manager.get_computed_blocks(request) if is_new
                             else (None, 0))
        assert num_hit % BLOCK_SIZE == 0 and num_hit < request.num_tokens
        remaining = request.num_tokens - request.num_computed_tokens - num_hit
        num_new = min(chunk, remaining)
        free_before = manager.num_free_blocks
        if manager.allocate_slots(request, num_new, computed, num_hit) is None:
            assert manager.num_free_blocks == free_before, "a failed allocation changed the pool"
            return False
        if is_new:
            self.running[request.request_id] = self.waiting.pop(request.request_id)
            self._check_hit(request, num_hit)
            request.num_computed_tokens = num_hit
        self._write_kv(request, request.num_computed_tokens, num_new)
        request.num_computed_tokens += num_new
        table = manager.req_to_blocks[request.request_id]
        assert len(table) == -(-request.num_computed_tokens // BLOCK_SIZE)
        return True

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = self.running.pop(request.request_id)

    # ---- rules -----------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 3), max_size=9),
          salt=st.sampled_from(["", "", "tenant-b"]), skip=st.booleans())
    def add_request(self, prefix: list[int], suffix: list[int], salt: str, skip: bool) -> None:
        self.count += 1
        request = Request(f"r{self.count}", prefix + suffix, max_tokens=16, arrival_time=0.0,
                          cache_salt=salt, skip_prefix_cache=skip and self.count % 3 == 0,
                          block_hasher=self.hasher)
        self.waiting[request.request_id] = request

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.waiting)))
        self._schedule(self.waiting[request_id], chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24), token=st.integers(1, 3))
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        """Runs a chunk (or a decode); on a full pool the request is preempted, as the
        scheduler does when it is its own victim."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_id(token)   # the token sampled last step
        if not self._schedule(request, chunk):
            self._preempt(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        request = self.running.pop(request_id, None) or self.waiting.pop(request_id)
        self.manager.free(request)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)
        if not self.running:
            assert not self.manager.block_pool.cached_block_hash_to_block

    # ---- invariants ------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self) -> None:
        check_kv_cache_manager(self.manager)
        assert set(self.manager.req_to_blocks) == set(self.running)

    def teardown(self) -> None:
        for request in list(self.running.values()):
            self.manager.free(request)
        check_kv_cache_manager(self.manager)
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1, "blocks leaked"
        assert all(block.ref_cnt == 0 for block in self.manager.block_pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = SETTINGS
