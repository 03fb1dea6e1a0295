"""What the gateway knows of the mesh, from heartbeats: which tokenizers and engines are
alive and ready, which models they serve, how loaded each engine is, and whether it still
makes progress (its step count moves while it holds work)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from services.common import wire
from services.common.packing import unpack_int32

# /health: the request path's services must each have a ready instance; the others, when
# the mesh runs any.
REQUIRED_KINDS = ("tokenizer", "scheduler", "worker")
OPTIONAL_KINDS = ("kvstore", "batch")


@dataclass
class Instance:
    service: str
    instance_id: str
    ready: bool
    reason: str
    last_seen: float
    engine_id: str = ""
    engine: wire.EngineInfo | None = None
    # A scheduler's: when its step count last moved, or it got work while idle. An engine
    # holding work while this stands still is hung (a worker stuck in a step, say).
    progress_at: float = 0.0

    @property
    def has_work(self) -> bool:
        return self.engine is not None and self.engine.num_running + self.engine.num_waiting > 0


@dataclass
class EngineView:
    engine_id: str
    scheduler_id: str
    model: str
    max_model_len: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    in_flight_here: int = 0      # requests this gateway sent and that have not finished
    kv_role: str = ""            # "", both, producer (prefill engine) or consumer
    is_stalled: bool = False     # holds work, no step for the stall timeout: picked last
    block_size: int = 16
    num_blocks: int = 0
    num_waiting_tokens: int = 0  # prompt tokens queued, not yet prefilled
    num_running_prefill_tokens: int = 0   # prompt tokens of running requests still to prefill
    max_num_seqs: int = 0        # 0: not reported
    max_loras: int = 0           # LoRA adapters a step may mix; 0: the engine serves none
    lora_ids: frozenset[int] = frozenset()   # adapters its worker holds in memory
    is_sleeping: bool = False    # sleep mode: it refuses requests until woken

    @property
    def can_start_another(self) -> bool:
        """A request sent now would run at once, not queue (as of the last heartbeat)."""
        return self.num_waiting == 0 and (self.max_num_seqs == 0
                                          or self.num_running < self.max_num_seqs)

    def has_room(self, busy_threshold: float) -> bool:
        """A request sent now would run at once, in a KV cache under busy_threshold (0..1):
        where a session may spill and a queued request may move."""
        return self.can_start_another and self.kv_cache_usage < busy_threshold

    @property
    def load(self) -> float:
        return self.num_running + self.num_waiting + self.in_flight_here


def least_loaded(engines: Collection[EngineView]) -> EngineView:
    """The engine with the fewest requests (running, waiting, sent from here); ties by id."""
    return min(engines, key=lambda e: (e.load, e.engine_id))


@dataclass
class MeshView:
    stale_after_s: float
    stall_after_s: float = 0.0   # the stall watchdog's timeout (0: off)
    instances: dict[str, Instance] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)   # engine id -> requests
    clock: Callable[[], float] = time.monotonic

    def on_heartbeat(self, beat: wire.Heartbeat) -> bool:
        """Records a heartbeat; True when it comes from an instance not seen before."""
        now = self.clock()
        previous = self.instances.get(beat.instance_id)
        instance = Instance(
            service=beat.service, instance_id=beat.instance_id, ready=beat.ready,
            reason=beat.reason, last_seen=now, engine_id=beat.engine_id,
            engine=beat.engine if beat.service == "scheduler" else None, progress_at=now)
        if (previous is not None and previous.engine is not None and previous.has_work
                and instance.engine is not None
                and instance.engine.num_steps == previous.engine.num_steps):
            instance.progress_at = previous.progress_at   # busy, and not one step since
        self.instances[beat.instance_id] = instance
        return previous is None

    def sweep(self) -> list[Instance]:
        """Forgets instances whose heartbeat stopped; returns them."""
        now = self.clock()
        gone = [i for i in self.instances.values() if now - i.last_seen > self.stale_after_s]
        for instance in gone:
            del self.instances[instance.instance_id]
        return gone

    def is_alive(self, instance_id: str) -> bool:
        return instance_id in self.instances

    def is_request_stalled(self, engine_id: str, last_output_at: float) -> bool:
        """The stall watchdog's rule: a request with no output for the stall timeout is
        stalled unless its engine, holding work with its worker ready, made progress in
        that time. (A request queued behind others on a busy engine is not stalled; one on
        an engine that is gone, idle or without its worker is.)"""
        if self.stall_after_s <= 0:
            return False
        since = self.clock() - self.stall_after_s
        if last_output_at > since:
            return False
        inst = self._scheduler_of(engine_id)
        return not (inst is not None and inst.engine is not None and inst.engine.worker_ready
                    and inst.has_work and inst.progress_at > since)

    def has_progressed(self, engine_id: str, since: float) -> bool:
        """Whether the engine stepped, or was seen idle, after `since` (a stalled engine
        that did is not stuck any more)."""
        inst = self._scheduler_of(engine_id)
        return inst is not None and inst.progress_at > since

    def is_stalled(self, instance: Instance) -> bool:
        """An engine holding work that has not stepped for the stall timeout."""
        return (self.stall_after_s > 0 and instance.has_work
                and self.clock() - instance.progress_at >= self.stall_after_s)

    def _scheduler_of(self, engine_id: str) -> Instance | None:
        return self.schedulers().get(engine_id)

    def schedulers(self) -> dict[str, Instance]:
        """Engine id -> its scheduler instance: of those ready, the one heard from last. A
        restarted scheduler's old instance stays in the view, with its last (ready)
        heartbeat, until the sweep drops it; once the new one is ready it is the engine.
        (One starting beside a live instance does not hide it while it loads.)"""
        latest: dict[str, Instance] = {}
        for inst in self.instances.values():
            if inst.service != "scheduler":
                continue
            seen = latest.get(inst.engine_id)
            if seen is None or (inst.ready, inst.last_seen) > (seen.ready, seen.last_seen):
                latest[inst.engine_id] = inst
        return latest

    def ready_engines(self, model: str | None = None) -> list[EngineView]:
        engines = []
        for inst in self.schedulers().values():
            info = inst.engine
            if not inst.ready or info is None:
                continue
            if model is not None and info.model != model:
                continue
            engines.append(EngineView(
                engine_id=inst.engine_id, scheduler_id=inst.instance_id, model=info.model,
                max_model_len=info.max_model_len,
                num_running=info.num_running, num_waiting=info.num_waiting,
                kv_cache_usage=info.kv_cache_usage,
                in_flight_here=self.in_flight.get(inst.engine_id, 0), kv_role=info.kv_role,
                is_stalled=self.is_stalled(inst), block_size=info.block_size or 16,
                num_blocks=info.num_blocks, num_waiting_tokens=info.num_waiting_tokens,
                num_running_prefill_tokens=info.num_running_prefill_tokens,
                max_num_seqs=info.max_num_seqs, max_loras=info.max_loras,
                lora_ids=(frozenset(unpack_int32(info.lora_ids).tolist()) if info.lora_ids
                          else frozenset()), is_sleeping=info.is_sleeping))
        return engines

    def models(self) -> dict[str, int]:
        """Served model name -> its max_model_len, over ready engines."""
        return {e.model: e.max_model_len for e in self.ready_engines()}

    def pick_engine(self, model: str, avoid: Collection[str] = (), needs_lora: bool = False,
                    prefer: str | None = None) -> EngineView | None:
        """`prefer` if it is one of candidate_engines() (serving LoRA, with needs_lora),
        else the least-loaded of them."""
        engines = self.candidate_engines(model, avoid)
        if needs_lora:
            engines = [e for e in engines if e.max_loras]
        preferred = next((e for e in engines if e.engine_id == prefer), None)
        return preferred or (least_loaded(engines) if engines else None)

    def candidate_engines(self, model: str, avoid: Collection[str] = ()) -> list[EngineView]:
        """The ready engines serving `model` a request may go to (none of `avoid`):
        prefill-only producers aside while another engine can decode, stalled or sleeping
        engines only when every other one is (a sleeping one then refuses it with a 503)."""
        engines = [e for e in self.ready_engines(model) if e.engine_id not in avoid]
        engines = [e for e in engines if not e.is_sleeping] or engines
        decoders = [e for e in engines if e.kv_role != "producer"] or engines
        return [e for e in decoders if not e.is_stalled] or decoders

    def pick_prefill_engine(self, model: str) -> EngineView | None:
        """Prefill/decode disaggregation: the least-loaded ready producer, when a consumer is
        ready too; None otherwise (requests then run on one engine)."""
        engines = self.ready_engines(model)
        producers = [e for e in engines if e.kv_role == "producer"]
        if not producers or not any(e.kv_role == "consumer" for e in engines):
            return None
        return least_loaded(producers)

    def health(self) -> tuple[bool, dict[str, str]]:
        """The mesh's /health: ready when every service it runs is, that is each kind of
        service has a ready instance: a tokenizer, a scheduler and a worker always, a kvstore
        node and a batch runner when any runs. One ready instance of a kind is enough (a
        second engine restarting does not take the whole mesh out of a load balancer); the
        detail says how many of each are ready, or why none is."""
        detail: dict[str, str] = {}
        for kind in REQUIRED_KINDS + OPTIONAL_KINDS:
            members = [i for i in self.instances.values() if i.service == kind]
            ready = [i for i in members if i.ready]
            if ready:
                detail[kind] = f"{len(ready)} ready"
            elif members:
                detail[kind] = "not ready: " + "; ".join(sorted({i.reason for i in members}))
            elif kind in REQUIRED_KINDS:
                detail[kind] = "none running"
        ok = all(v.endswith(" ready") and not v.startswith("not") for v in detail.values())
        return ok, detail

    def track(self, engine_id: str, delta: int) -> None:
        self.in_flight[engine_id] = max(0, self.in_flight.get(engine_id, 0) + delta)
