"""Weight updates' endpoints at the gateway (services/gateway/weight_routes.py): the two
phases over every engine, against engines that answer as a script says. Every engine takes
the new weights or none does. The engines' side runs in tests/e2e/test_trainer_loop.py."""

from __future__ import annotations

from types import SimpleNamespace

import httpx2 as httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common import wire
from services.common.metrics import GatewayMetrics
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_view import MeshView
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

ADMIN = {"Authorization": "Bearer operator"}


class ScriptedEngines:
    """Engines that answer admin commands: each serves a version, and a load fails on the
    engines named in `fail_load`."""

    def __init__(self, engines: list[str], fail_load: set[str] = frozenset()):
        self.versions = dict.fromkeys(engines, "default")
        self.staged: dict[str, str] = {}
        self.fail_load = fail_load
        self.calls: list[tuple[str, str]] = []
        self.gateway_id = "weights-test"

    async def admin(self, engine: str, command: str, *, model_path: str = "",
                    weight_version: str = "", **_: object) -> wire.AdminReply:
        self.calls.append((engine, command))
        if command == "load_weights":
            if engine in self.fail_load:
                return wire.AdminReply(error=f"no .safetensors weights in {model_path}",
                                       http_status=400, weight_version=self.versions[engine])
            self.staged[engine] = weight_version
        elif command == "commit_weights":
            self.versions[engine] = self.staged.pop(engine)
        elif command == "discard_weights":
            self.staged.pop(engine, None)
        return wire.AdminReply(ok=True, weight_version=self.versions[engine], seconds=0.5)


def engine_beat(engine_id: str) -> wire.Heartbeat:
    return wire.Heartbeat(service="scheduler", instance_id=f"s-{engine_id}", ready=True,
                          engine_id=engine_id, engine=wire.EngineInfo(
                              model="m", max_model_len=2048, block_size=16, num_blocks=100,
                              worker_ready=True, num_steps=1, max_num_seqs=8))


def gateway(engines: ScriptedEngines) -> httpx.AsyncClient:
    settings = GatewaySettings(api_key=["tenant"], admin_api_key=["operator"])
    view = MeshView(60.0)
    for engine in engines.versions:
        view.on_heartbeat(engine_beat(engine))
    ctx = FrontendContext(settings, engines, view,  # type: ignore[arg-type]
                          GatewayMetrics(CollectorRegistry()))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx, CollectorRegistry())),
                             base_url="http://gateway")


async def test_every_engine_loads_then_every_engine_commits() -> None:
    engines = ScriptedEngines(["e0", "e1"])
    async with gateway(engines) as http:
        answer = await http.post("/update_weights_from_disk", headers=ADMIN,
                                 json={"model_path": "/ckpt/step-1", "weight_version": "step-1"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["weight_version"] == "step-1"
        assert set(answer.json()["engines"]) == {"e0", "e1"}
        version = await http.get("/get_weight_version", headers=ADMIN)
    assert version.json() == {"weight_version": "step-1",
                              "engines": {"e0": "step-1", "e1": "step-1"}}
    commands = [command for _, command in engines.calls]
    last_load = max(i for i, c in enumerate(commands) if c == "load_weights")
    first_commit = commands.index("commit_weights")
    assert last_load < first_commit   # no engine swaps before every engine has loaded


async def test_one_engine_failing_its_load_leaves_every_engine_on_its_weights() -> None:
    engines = ScriptedEngines(["e0", "e1"], fail_load={"e1"})
    async with gateway(engines) as http:
        answer = await http.post("/update_weights_from_disk", headers=ADMIN,
                                 json={"model_path": "/nowhere", "weight_version": "step-1"})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "update_weights_failed"
        assert "engine e1" in error["message"] and ".safetensors" in error["message"]
        version = await http.get("/get_weight_version", headers=ADMIN)
    assert version.json()["weight_version"] == "default"
    assert ("e0", "discard_weights") in engines.calls
    assert not any(command == "commit_weights" for _, command in engines.calls)
    assert engines.staged == {}


async def test_a_version_an_engine_already_serves_is_refused() -> None:
    engines = ScriptedEngines(["e0"])
    async with gateway(engines) as http:
        answer = await http.post("/update_weights_from_disk", headers=ADMIN,
                                 json={"model_path": "/ckpt", "weight_version": "default"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "weight_version"
    assert not any(command == "load_weights" for _, command in engines.calls)


async def test_an_update_without_a_version_gets_a_new_one_each_time() -> None:
    engines = ScriptedEngines(["e0"])
    async with gateway(engines) as http:
        first = await http.post("/update_weights_from_disk", headers=ADMIN,
                                json={"model_path": "/ckpt/a"})
        second = await http.post("/update_weights_from_disk", headers=ADMIN,
                                 json={"model_path": "/ckpt/b"})
    versions = {first.json()["weight_version"], second.json()["weight_version"]}
    assert len(versions) == 2 and "default" not in versions


@pytest.mark.parametrize(("method", "path"), [("POST", "/update_weights_from_disk"),
                                              ("GET", "/get_weight_version")])
async def test_only_an_admin_key_updates_weights(method: str, path: str) -> None:
    engines = ScriptedEngines(["e0"])
    async with gateway(engines) as http:
        refused = await http.request(method, path, headers={"Authorization": "Bearer tenant"},
                                     json={"model_path": "/ckpt"})
    assert refused.status_code == 403
    assert engines.calls == []
