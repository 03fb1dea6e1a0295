"""The batch runner gets the gateway's API keys and rate limits wherever the mesh is started
(`llm-mesh up`, compose): without them it would fail every batch created with a key."""

from __future__ import annotations

import pytest

from llm_mesh.launcher import service_argv
from services.batch.settings import BatchSettings
from services.common.settings import build_settings
from tests.compose.model import MAIN, load, mesh_services


def test_llm_mesh_up_hands_the_runner_the_keys_in_its_environment() -> None:
    explicit = {"api_key": ["key-one", "key-two"], "rate_limit_tokens_per_minute": 6000,
                "max_concurrent_lines": 8}
    argv, env = service_argv("batch", explicit)
    assert not any("key-" in arg for arg in argv)   # a command line is readable by all
    runner = build_settings(BatchSettings, {}, environ=env)
    assert runner.api_key == ["key-one", "key-two"]
    assert "--rate-limit-tokens-per-minute" in argv and "--max-concurrent-lines" in argv


def test_compose_gives_the_runner_the_gateways_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    services = {s.kind: s for s in mesh_services(load([MAIN], environ={"API_KEYS": "a,b"}))}
    gateway = services["gateway"].settings(monkeypatch)
    runner = services["batch"].settings(monkeypatch)
    assert runner.api_key == gateway.api_key == ["a", "b"]
