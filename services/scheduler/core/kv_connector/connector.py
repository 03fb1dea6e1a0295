"""The scheduler side of the KV connector, after vLLM's KVConnectorBase_V1 (scheduler role).

It decides, without I/O, what moves between the worker's KV tensors and the kvstore:
- loads: a waiting request whose leading blocks the store holds beyond the local prefix
  cache gets blocks for them and waits (WAITING_FOR_REMOTE_KVS) while the worker fills
  them over gRPC; other requests keep running. The store lookup itself ran before the request
  was admitted (services/scheduler/kv/lookup.py), so the step loop never waits on Redis.
- saves: by save mode, a prompt's cached blocks the first time a later request reuses them
  (on_reuse, the default: a prefix seen once seldom comes back, one seen twice does —
  SGLang's write_through_selective), every full prompt block a step computes (write_through),
  or cached blocks when the pool reuses them (on_evict).
- a producer request (prefill/decode disaggregation) finishes only once the store
  acknowledged every full block of its prompt.
The engine core calls it at fixed points (scheduler.py); the worker reports results in
StepOutput, which the core hands back through `take_load_results`. Pure, like the rest of
core/: the service side (lookup, wire columns, metrics) lives in services/scheduler/kv/.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.scheduler.core.kv_connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    KVRole,
    KVSave,
    LoadFailurePolicy,
    SaveMode,
)
from services.scheduler.core.output import EngineCoreOutput
from services.scheduler.core.request import Request

_INT32_MAX = 2**31 - 1
# Hashes of blocks this engine saved or loaded, so a prefix reused again is not saved again
# (a bound: the store forgets blocks too; one that falls out is at worst saved twice).
_MAX_KNOWN_STORED = 1 << 16


@dataclass(slots=True)
class _Loading:
    request: Request
    num_local_tokens: int
    num_blocks: int
    started: float


class SchedulerKVConnector:
    def __init__(self, block_size: int, role: KVRole, save_mode: SaveMode,
                 failure_policy: LoadFailurePolicy,
                 live_nodes: Callable[[], Sequence[str]]) -> None:
        self.block_size = block_size
        self.role = role
        self.save_mode = save_mode
        self.failure_policy = failure_policy
        self._live_nodes = live_nodes
        self._loading: dict[int, _Loading] = {}           # handle -> load in flight
        self._new_loads: list[KVLoad] = []
        self._reused: dict[Request, int] = {}              # admitted this step: blocks hit
        self._known_stored: OrderedDict[bytes, None] = OrderedDict()
        self._reuse_saves: dict[int, list[bytes]] = {}    # save id -> hashes (on_reuse)
        self._save_sizes: dict[int, int] = {}             # save id -> blocks, until reported
        self._saves_of: dict[int, int] = {}               # save id -> handle (producers)
        self._pending_saves: dict[int, int] = {}          # handle -> unacknowledged saves
        self._held: dict[int, EngineCoreOutput] = {}      # producer finishes awaiting saves
        self._next_save_id = 0
        self._output = KVConnectorOutput()
        self._load_times: list[float] = []
        # Counters the service turns into metrics (tokens, cumulative).
        self.num_hit_tokens = 0
        self.num_load_failures = 0
        self.num_saved_blocks = 0
        self.num_save_failures = 0

    # ---- loads (the core, in schedule())
    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Tokens beyond the local prefix hits that the store holds, in whole blocks; the
        last prompt token is never loaded (its logits must be computed)."""
        nodes = request.kv_store_hit
        if not nodes or request.skip_prefix_cache:
            return 0
        max_blocks = min(len(nodes), (request.num_tokens - 1) // self.block_size)
        return max(0, max_blocks - num_local_tokens // self.block_size) * self.block_size

    def start_load(self, request: Request, num_local_tokens: int, block_ids: list[int],
                   now: float) -> None:
        """The core allocated `block_ids` for the blocks after the local hits."""
        first = num_local_tokens // self.block_size
        nodes, request.kv_store_hit = request.kv_store_hit, []
        load = KVLoad(request.handle, block_ids,
                      request.block_hashes[first:first + len(block_ids)],
                      nodes[first:first + len(block_ids)])
        self._remember_stored(load.block_hashes)
        assert request.handle is not None
        self._loading[request.handle] = _Loading(request, num_local_tokens, len(block_ids), now)
        self._new_loads.append(load)

    def take_load_results(self, now: float) -> list[tuple[Request, int, int, bool]]:
        """Loads the worker finished: (request, local tokens, tokens loaded, failed)."""
        results = []
        for handle, num_blocks, failed in self._output.loaded:
            loading = self._loading.pop(handle, None)
            if loading is None:
                continue   # aborted meanwhile
            num_blocks = min(num_blocks, loading.num_blocks)
            failed = failed or num_blocks < loading.num_blocks
            self.num_hit_tokens += num_blocks * self.block_size
            self.num_load_failures += failed
            self._load_times.append(now - loading.started)
            results.append((loading.request, loading.num_local_tokens,
                            num_blocks * self.block_size, failed))
        self._output.loaded = []
        return results

    def take_load_times(self) -> list[float]:
        """Seconds each finished load took, since the last call."""
        times, self._load_times = self._load_times, []
        return times

    @property
    def fails_requests_on_load_failure(self) -> bool:
        return self.failure_policy is LoadFailurePolicy.FAIL

    @property
    def saves_on_eviction(self) -> bool:
        return self.save_mode is SaveMode.ON_EVICT and self.role is not KVRole.CONSUMER

    # ---- saves (the core, when it admits a request and when it builds a step)
    def prefix_reused(self, request: Request, num_local_tokens: int) -> None:
        """A request's first admission hit `num_local_tokens` in the local prefix cache: in
        save mode on_reuse, those of its blocks not stored yet are saved in this step (if it
        is still scheduled when the step is built)."""
        if self.save_mode is SaveMode.ON_REUSE and self.role is not KVRole.CONSUMER:
            self._reused[request] = num_local_tokens // self.block_size

    def _save_reused(self, request: Request, num_blocks: int,
                     block_ids_of: Callable[[str], list[int]],
                     nodes: Sequence[str]) -> KVSave | None:
        fresh = [i for i in range(num_blocks)
                 if request.block_hashes[i] not in self._known_stored]
        if not fresh:
            return None
        block_ids = block_ids_of(request.request_id)
        hashes = [request.block_hashes[i] for i in fresh]
        save = KVSave(self._new_save_id(), [block_ids[i] for i in fresh], hashes,
                      _pick_node(nodes, hashes[0]), False)
        self._remember_stored(hashes)
        self._reuse_saves[save.save_id] = hashes
        return save

    def _remember_stored(self, hashes: Sequence[bytes]) -> None:
        for block_hash in hashes:
            self._known_stored[block_hash] = None
            self._known_stored.move_to_end(block_hash)
        while len(self._known_stored) > _MAX_KNOWN_STORED:
            self._known_stored.popitem(last=False)

    def build_meta(self, scheduled: Sequence[tuple[Request, int]],
                   block_ids_of: Callable[[str], list[int]],
                   evicted: Sequence[tuple[int, bytes]]) -> KVConnectorMetadata:
        """Loads started and blocks to save this step. `scheduled`: (request, tokens this step)
        of every scheduled request; `evicted`: (block id, hash) of cached blocks the pool
        reused this step."""
        meta = KVConnectorMetadata(self._new_loads)
        self._new_loads = []
        reused, self._reused = self._reused, {}
        nodes = self._live_nodes()
        if not nodes or self.role is KVRole.CONSUMER:
            return meta
        if self.save_mode is SaveMode.ON_EVICT:
            for block_id, block_hash in evicted:
                meta.saves.append(KVSave(self._new_save_id(), [block_id], [block_hash],
                                         _pick_node(nodes, block_hash), True))
        for request, num_new_tokens in scheduled:
            save = self._write_through(request, num_new_tokens, block_ids_of, nodes)
            if save is None and request in reused:
                save = self._save_reused(request, reused[request], block_ids_of, nodes)
            if save is not None:
                meta.saves.append(save)
        for save in meta.saves:
            self._save_sizes[save.save_id] = len(save.block_ids)
        return meta

    def _write_through(self, request: Request, num_new_tokens: int,
                       block_ids_of: Callable[[str], list[int]],
                       nodes: Sequence[str]) -> KVSave | None:
        size = self.block_size
        end = min((request.num_computed_tokens + num_new_tokens) // size,
                  request.num_prompt_tokens // size, len(request.block_hashes))
        if request.do_remote_decode:
            # A producer stores its whole prompt, prefix hits included: the consumer loads
            # from the store only. Saved from the step that completes the prompt.
            if request.num_computed_tokens + num_new_tokens < request.num_prompt_tokens:
                return None
            start = 0
        elif self.save_mode is SaveMode.WRITE_THROUGH:
            start = request.num_computed_tokens // size
        else:
            return None
        if start >= end:
            return None
        hashes = request.block_hashes[start:end]
        save = KVSave(self._new_save_id(), block_ids_of(request.request_id)[start:end], hashes,
                      _pick_node(nodes, hashes[0]), False)
        if request.do_remote_decode:
            assert request.handle is not None
            self._saves_of[save.save_id] = request.handle
            self._pending_saves[request.handle] = self._pending_saves.get(request.handle, 0) + 1
        return save

    def _new_save_id(self) -> int:
        save_id = self._next_save_id
        self._next_save_id = save_id + 1 if save_id < _INT32_MAX else 0
        return save_id

    def hold_finished(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs to send now: a producer request's finish waits until the worker reported
        every save of its prompt (stored or not), so the consumer's lookup finds the blocks."""
        ready = []
        for output in outputs:
            if output.finished and output.handle in self._pending_saves:
                self._held[output.handle] = output
            else:
                ready.append(output)
        for handle in self._take_saved_handles():
            held = self._held.pop(handle, None)
            if held is not None:
                ready.append(held)
        return ready

    def release_held(self) -> list[EngineCoreOutput]:
        """The worker is gone with its saves in flight: finish the held requests anyway (the
        consumer recomputes what the store lacks)."""
        held = list(self._held.values())
        self._held.clear()
        self._pending_saves.clear()
        self._saves_of.clear()
        self._save_sizes.clear()
        for hashes in self._reuse_saves.values():   # lost with the worker: not stored
            for block_hash in hashes:
                self._known_stored.pop(block_hash, None)
        self._reuse_saves.clear()
        return held

    def _take_saved_handles(self) -> list[int]:
        """Producer requests whose every save the worker reported (stored or not)."""
        done = []
        for save_id, ok in self._output.saved:
            num_blocks = self._save_sizes.pop(save_id, 0)
            reused = self._reuse_saves.pop(save_id, ())
            if ok:
                self.num_saved_blocks += num_blocks
            else:
                self.num_save_failures += 1
                for block_hash in reused:   # saved again at its next reuse
                    self._known_stored.pop(block_hash, None)
            handle = self._saves_of.pop(save_id, None)
            if handle is None:
                continue
            left = self._pending_saves[handle] - 1
            if left:
                self._pending_saves[handle] = left
            else:
                del self._pending_saves[handle]
                done.append(handle)
        self._output.saved = []
        return done

    # ---- worker reports and request ends
    def update_from_output(self, output: KVConnectorOutput) -> None:
        self._output.loaded += output.loaded
        self._output.saved += output.saved

    def request_finished(self, request: Request) -> None:
        """Forgets a request's load (the worker cancels it: the handle is in the step's
        finished handles)."""
        request.kv_store_hit = []
        if request.handle is not None:
            self._loading.pop(request.handle, None)

    @property
    def has_work(self) -> bool:
        """Transfers in flight: the scheduler keeps stepping to collect their results."""
        return bool(self._loading or self._saves_of or self._new_loads)


def _pick_node(nodes: Sequence[str], block_hash: bytes) -> str:
    # NOTE: rendezvous hashing: every scheduler sends a block to the same node while the node
    # set holds, and a node leaving moves only its own share.
    return max(nodes, key=lambda node: hashlib.blake2b(node.encode() + block_hash,
                                                       digest_size=8).digest())
