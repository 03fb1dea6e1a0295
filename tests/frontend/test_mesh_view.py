from services.common import wire
from services.frontend.engine_client.mesh_view import MeshView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(service: str, instance: str, ready: bool = True, engine_id: str = "",
         running: int = 0, model: str = "m") -> wire.Heartbeat:
    info = wire.EngineInfo(model=model, max_model_len=2048, num_running=running) \
        if service == "scheduler" else None
    return wire.Heartbeat(service=service, instance_id=instance, ready=ready,
                          reason="" if ready else "loading model", engine_id=engine_id,
                          engine=info)


def test_health_needs_a_ready_tokenizer_scheduler_and_worker() -> None:
    view = MeshView(stale_after_s=3.0, clock=Clock())
    assert view.health()[0] is False
    view.on_heartbeat(beat("tokenizer", "t1"))
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e0"))
    view.on_heartbeat(beat("worker", "w1", ready=False, engine_id="e0"))
    ok, detail = view.health()
    assert not ok and detail["worker"] == "not ready: loading model"
    view.on_heartbeat(beat("worker", "w1", engine_id="e0"))
    assert view.health()[0] is True


def test_health_needs_every_kvstore_and_batch_kind_that_runs_ready() -> None:
    view = MeshView(stale_after_s=3.0, clock=Clock())
    for service, instance in (("tokenizer", "t1"), ("scheduler", "s1"), ("worker", "w1")):
        view.on_heartbeat(beat(service, instance, engine_id="e0"))
    ok, detail = view.health()
    assert ok and "kvstore" not in detail and "batch" not in detail   # none runs: not needed
    view.on_heartbeat(beat("kvstore", "k1", ready=False))
    view.on_heartbeat(beat("batch", "b1"))
    ok, detail = view.health()
    assert not ok and detail["kvstore"] == "not ready: loading model"
    assert detail["batch"] == "1 ready"
    view.on_heartbeat(beat("kvstore", "k1"))
    assert view.health() == (True, {"tokenizer": "1 ready", "scheduler": "1 ready",
                                    "worker": "1 ready", "kvstore": "1 ready",
                                    "batch": "1 ready"})


def test_one_ready_instance_of_each_kind_is_enough() -> None:
    view = MeshView(stale_after_s=3.0, clock=Clock())
    for service, instance in (("tokenizer", "t1"), ("scheduler", "s1"), ("worker", "w1"),
                              ("scheduler", "s2"), ("worker", "w2")):
        view.on_heartbeat(beat(service, instance, engine_id="e" + instance[-1]))
    view.on_heartbeat(beat("worker", "w2", ready=False, engine_id="e2"))   # restarting
    ok, detail = view.health()
    assert ok and detail["worker"] == "1 ready"


def test_silent_instances_are_swept_and_engines_picked_by_load() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.0, clock=clock)
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e0", running=5))
    view.on_heartbeat(beat("scheduler", "s2", engine_id="e1", running=1))
    assert view.pick_engine("m").engine_id == "e1"
    view.track("e1", +10)  # requests this gateway sent since the last heartbeat
    assert view.pick_engine("m").engine_id == "e0"
    assert view.pick_engine("other") is None and view.models() == {"m": 2048}
    clock.now += 2.0
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e0", running=5))
    clock.now += 2.0
    gone = view.sweep()
    assert [i.instance_id for i in gone] == ["s2"]
    assert [e.engine_id for e in view.ready_engines()] == ["e0"]


def test_a_preferred_engine_is_picked_while_it_is_a_candidate() -> None:
    view = MeshView(stale_after_s=3.0, clock=Clock())
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e0", running=5))
    view.on_heartbeat(beat("scheduler", "s2", engine_id="e1", running=1))
    assert view.pick_engine("m", prefer="e0").engine_id == "e0"
    # Avoided, gone, or unable to serve the request: the least loaded instead.
    assert view.pick_engine("m", ["e0"], prefer="e0").engine_id == "e1"
    assert view.pick_engine("m", prefer="e9").engine_id == "e1"
    assert view.pick_engine("m", needs_lora=True, prefer="e0") is None


def test_a_restarted_scheduler_replaces_its_old_instance_before_the_sweep() -> None:
    clock = Clock()
    view = MeshView(stale_after_s=3.0, clock=clock)
    view.on_heartbeat(beat("scheduler", "s-old", engine_id="e0", running=5))
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e1", running=1))
    clock.now += 1.0   # s-old was killed; its last heartbeat still says ready
    view.on_heartbeat(beat("scheduler", "s-new", ready=False, engine_id="e0"))
    # While s-new loads, e0 stays listed as s-old (a request sent there meets s-new's 503
    # and goes to another engine): one instance starting beside a live one must not hide it.
    assert sorted(e.scheduler_id for e in view.ready_engines()) == ["s-old", "s1"]
    clock.now += 1.0
    view.on_heartbeat(beat("scheduler", "s-new", engine_id="e0"))
    view.on_heartbeat(beat("scheduler", "s1", engine_id="e1", running=1))
    assert sorted(e.scheduler_id for e in view.ready_engines()) == ["s-new", "s1"]
    assert view.pick_engine("m").scheduler_id == "s-new"   # its load, not s-old's
    clock.now += 2.5
    assert [i.instance_id for i in view.sweep()] == ["s-old"]
