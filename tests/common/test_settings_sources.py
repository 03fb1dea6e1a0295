"""One source per setting: each flag is declared once (or is a known pair, below), the engine
core's configuration defaults to what the scheduler's settings give it, and the liveness
timeouts come from services/common/timing.py, which refuses one a late heartbeat exceeds."""

from __future__ import annotations

import dataclasses

import pytest

from services.batch.settings import BatchSettings
from services.common import timing, wire
from services.common.settings import build_settings
from services.gateway.settings import GatewaySettings
from services.kvstore.settings import KVStoreSettings
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.settings import SchedulerSettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings

SERVICE_SETTINGS = [GatewaySettings, BatchSettings, TokenizerSettings, SchedulerSettings,
                    WorkerSettings, KVStoreSettings]

# Names two settings classes declare, each for a concern of its own service; `llm-mesh up`
# hands a flag given once to both. Any other name is declared once and inherited.
SAME_NAME_DIFFERENT_CONCERN = {
    "enable_kv_events": "a scheduler publishes its pool's events, a kvstore node its tiers'",
    "grammar_cache_size": "the tokenizer's compiles check grammars, the worker's match them",
    "redis_url": "the gateway's token buckets, and the kvstore's block index",
    "stall_timeout_s": "a scheduler's readiness, and the gateway's stall watchdog",
}


def _declaring_classes() -> dict[str, set[type]]:
    declared: dict[str, set[type]] = {}
    for settings in SERVICE_SETTINGS:
        for field in dataclasses.fields(settings):
            owner = next(cls for cls in settings.__mro__
                         if field.name in vars(cls).get("__annotations__", {}))
            declared.setdefault(field.name, set()).add(owner)
    return declared


def test_each_setting_is_declared_once_but_the_known_pairs() -> None:
    twice = {name: sorted(cls.__name__ for cls in owners)
             for name, owners in _declaring_classes().items() if len(owners) > 1}
    assert twice.keys() == SAME_NAME_DIFFERENT_CONCERN.keys(), twice


def test_the_gateway_batch_runner_and_tokenizer_share_one_instance_timeout() -> None:
    owners = _declaring_classes()["instance_timeout_s"]
    assert len(owners) == 1
    for settings in (GatewaySettings, BatchSettings, TokenizerSettings):
        assert settings().instance_timeout_s == timing.INSTANCE_TIMEOUT_S
    assert SchedulerSettings().worker_heartbeat_timeout_s == timing.WORKER_HEARTBEAT_TIMEOUT_S


@pytest.mark.parametrize(("settings", "name"), [
    (GatewaySettings, "instance_timeout_s"), (TokenizerSettings, "instance_timeout_s"),
    (SchedulerSettings, "worker_heartbeat_timeout_s")])
def test_a_timeout_one_late_heartbeat_exceeds_is_refused(settings: type, name: str) -> None:
    too_short = timing.MIN_HEARTBEATS_PER_TIMEOUT * timing.HEARTBEAT_INTERVAL_S
    with pytest.raises(SystemExit, match="heartbeats come every"):
        build_settings(settings, {name: too_short}, {})
    assert getattr(build_settings(settings, {name: too_short + 0.5}, {}), name) == \
        too_short + 0.5


def test_the_engine_core_defaults_to_what_the_settings_give_it() -> None:
    worker = wire.WorkerInfo(num_blocks=100, block_size=16, max_model_len=2048, max_loras=0,
                             max_cpu_loras=0)
    from_settings = SchedulerSettings().scheduler_config(worker)
    core_defaults = SchedulerConfig(num_gpu_blocks=100, block_size=16, max_model_len=2048)
    assert from_settings == core_defaults
