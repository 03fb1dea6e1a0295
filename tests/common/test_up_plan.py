"""`llm-mesh up --data-parallel-size N`: what each engine's scheduler and worker are given
(ids, threads, KV cache sizing), and the flag itself; no process is started."""

from __future__ import annotations

import pytest

from services.common.ports import free_ports
from llm_mesh.engines import plan_engines
from llm_mesh.launcher import service_argv, up_parser
from services.common.settings import build_settings
from services.worker.settings import WorkerSettings


def worker_settings(**explicit: object) -> WorkerSettings:
    return build_settings(WorkerSettings, explicit, environ={})


def test_one_engine_keeps_its_id_the_cores_and_the_default_kv_share() -> None:
    [engine] = plan_engines(worker_settings(), 1, cores=8)
    assert engine.overrides == {"engine_id": "engine-0", "num_threads": 8,
                                "enable_kv_events": False,
                                "kv_cache_memory_fraction": 0.25,
                                "gpu_memory_utilization": 0.9}
    [engine] = plan_engines(worker_settings(engine_id="cpu-a"), 1, cores=8)
    assert engine.engine_id == "cpu-a"


def test_engines_split_the_cores_and_the_memory_shares() -> None:
    engines = plan_engines(worker_settings(), 3, cores=8)
    assert [e.engine_id for e in engines] == ["engine-0", "engine-1", "engine-2"]
    for engine in engines:
        assert engine.overrides["num_threads"] == 2
        assert engine.overrides["kv_cache_memory_fraction"] == pytest.approx(0.25 / 3)
        assert engine.overrides["gpu_memory_utilization"] == pytest.approx(0.3)
    # A share the user chose is of the machine too; more engines than cores share them.
    engines = plan_engines(worker_settings(kv_cache_memory_fraction=0.5, engine_id="cpu"),
                           4, cores=2)
    assert [e.engine_id for e in engines] == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"]
    assert {e.overrides["num_threads"] for e in engines} == {1}
    assert {e.overrides["kv_cache_memory_fraction"] for e in engines} == {0.125}


def test_explicit_threads_and_kv_bytes_are_per_engine() -> None:
    engines = plan_engines(worker_settings(num_threads=3, kv_cache_memory=2**29), 2, cores=16)
    for engine in engines:
        assert engine.overrides == {"engine_id": engine.engine_id, "num_threads": 3,
                                    "enable_kv_events": True}
        argv, _ = service_argv("worker", {"kv_cache_memory": 2**29, **engine.overrides})
        assert argv[argv.index("--kv-cache-memory") + 1] == str(2**29)
    # Set as a variable instead, which the workers read too.
    from_env = build_settings(WorkerSettings, {}, environ={"LLM_MESH_KV_CACHE_MEMORY": "2048"})
    assert "kv_cache_memory_fraction" not in plan_engines(from_env, 2, cores=4)[0].overrides


def test_each_service_gets_the_overrides_it_declares() -> None:
    explicit = {"max_model_len": 2048, "num_threads": 0}
    engine = plan_engines(worker_settings(**explicit), 2, cores=4)[1]
    settings = {**explicit, **engine.overrides}
    scheduler_argv, _ = service_argv("scheduler", settings)
    # More than one engine: the schedulers publish KV events for the gateways' router.
    assert scheduler_argv == ["--max-model-len", "2048", "--enable-kv-events",
                              "--engine-id", "engine-1"]
    worker_argv, _ = service_argv("worker", settings)
    worker = up_parser().parse_args(worker_argv)   # every worker flag is an up flag too
    assert (worker.engine_id, worker.num_threads, worker.max_model_len) == ("engine-1", 2, 2048)
    assert worker.kv_cache_memory_fraction == 0.125


def test_kv_events_as_given_else_on_for_more_than_one_engine() -> None:
    assert not plan_engines(worker_settings(), 2, cores=2, enable_kv_events=False)[0] \
        .overrides["enable_kv_events"]
    assert plan_engines(worker_settings(), 1, cores=2, enable_kv_events=True)[0] \
        .overrides["enable_kv_events"]


def test_ports_are_distinct() -> None:
    ports = free_ports(32)
    assert len(set(ports)) == 32


def test_the_flag_its_short_form_and_its_help() -> None:
    parser = up_parser()
    assert parser.parse_args(["--data-parallel-size", "3"]).data_parallel_size == 3
    assert parser.parse_args(["-dp", "2"]).data_parallel_size == 2
    assert "data_parallel_size" not in vars(parser.parse_args([]))   # only flags given
    assert "--data-parallel-size N, -dp N" in parser.format_help()
