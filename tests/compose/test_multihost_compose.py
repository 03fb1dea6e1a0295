"""compose/docker-compose.multihost.yml, the deployment over three machines: Compose accepts
it on top of the main file and the TLS overlay; every mesh service lists the three NATS
nodes as its own role, keeps what it creates on three nodes and finds Redis on the front
machine; and compose/nats/nats-cluster.conf, run as three real nats-server nodes with the
dev certificates, forms one cluster over mutual TLS on which a service (TLS, its role)
creates a stream replicated on all three."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from services.common.ports import free_port
from services.common.bus import Bus
from tests.compose.compose_nats import ComposeNats
from tests.compose.conftest import CERT_HOSTS
from tests.compose.model import COMPOSE_DIR, MAIN, TLS, load, mesh_services, run_compose

MULTIHOST = COMPOSE_DIR / "docker-compose.multihost.yml"
FILES = (MAIN, TLS, MULTIHOST)
HOSTS = {"NATS_HOST_1": "front.example", "NATS_HOST_2": "gpu-1.example",
         "NATS_HOST_3": "gpu-2.example", "FRONT_HOST": "front.example", "ENGINE_ID": "engine-7"}
ROLES = {"gateway": "gateway", "batch": "batch", "tokenizer": "tokenizer",
         "scheduler": "engine", "worker": "engine", "kvstore": "kvstore"}


def test_compose_accepts_the_overlay() -> None:
    result = run_compose(FILES, ("gpu",), "config", "-q")
    assert result.returncode == 0, result.stderr
    assert "WARN" not in result.stderr, result.stderr


@pytest.mark.parametrize("svc", mesh_services(load(FILES, ("gpu",), HOSTS)),
                         ids=lambda s: s.name)
def test_every_service_lists_the_three_nodes_as_its_role(svc, monkeypatch) -> None:
    settings = svc.settings(monkeypatch)
    urls = [url.split("@") for url in settings.nats_url.split(",")]
    role = ROLES[svc.kind]
    assert [host for _, host in urls] == [f"{HOSTS[f'NATS_HOST_{i}']}:4222" for i in (1, 2, 3)]
    assert all(login.startswith(f"tls://{role}:") for login, _ in urls)
    assert settings.nats_tls_ca_file and settings.nats_tls_cert_file
    if svc.kind in ("gateway", "batch", "scheduler", "kvstore"):
        assert settings.jetstream_replicas == 3
    if svc.kind in ("scheduler", "worker") and not svc.name.endswith("-gpu"):
        assert settings.engine_id == "engine-7"
    if getattr(settings, "redis_url", ""):
        assert "@front.example:6379/" in settings.redis_url
    if svc.kind == "kvstore":
        assert settings.advertise_address == "front.example:50051"


class ClusterNode(ComposeNats):
    """A node of the cluster config: flags move its client, monitoring and cluster ports to
    free ones; the routes come, as in the container, from the environment."""

    def __init__(self, config: Path, name: str, cluster_port: int, routes: list[str]):
        super().__init__(config)
        self.name, self.cluster_port, self.routes = name, cluster_port, routes

    def _extra_args(self) -> list[str]:
        return [*super()._extra_args(), "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
                "--server_name", self.name]

    def _server_env(self) -> dict[str, str]:
        routes = {f"NATS_ROUTE_{i}": route for i, route in enumerate(self.routes, start=1)}
        return {**super()._server_env(), "NATS_SERVER_NAME": self.name, **routes}


def _cluster_config(dev_certs: Path, directory: Path) -> Path:
    """The three conf files as the overlay mounts them, the certificates moved."""
    directory.mkdir()
    shutil.copy(COMPOSE_DIR / "nats" / "nats.conf", directory)
    for name in ("nats-tls.conf", "nats-cluster.conf"):
        text = (COMPOSE_DIR / "nats" / name).read_text()
        (directory / name).write_text(text.replace("/etc/nats/tls/", f"{dev_certs}/"))
    return directory / "nats-cluster.conf"


async def test_three_nodes_form_a_cluster_that_replicates_streams(
        dev_certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _cluster_config(dev_certs, tmp_path / "nats")
    ports = [free_port() for _ in CERT_HOSTS]
    routes = [f"nats-route://127.0.0.1:{port}" for port in ports]
    nodes = [ClusterNode(config, name, port, routes) for name, port in zip(CERT_HOSTS, ports)]
    try:
        for node in nodes:
            node.start()
        [gateway] = [s for s in mesh_services(load(FILES, (), HOSTS)) if s.kind == "gateway"]
        settings = gateway.settings(monkeypatch)
        in_container = Path(settings.nats_tls_ca_file).parent
        password = settings.nats_url.split(":")[2].split("@")[0]
        settings.nats_url = ",".join(f"tls://gateway:{password}@127.0.0.1:{node.port}"
                                     for node in nodes)
        for name in ("nats_tls_ca_file", "nats_tls_cert_file", "nats_tls_key_file"):
            setattr(settings, name,
                    str(dev_certs / Path(getattr(settings, name)).relative_to(in_container)))
        bus = await Bus.for_settings(settings, "multihost-test", retry_for_s=10.0)
        try:
            info = await _add_replicated_stream(bus, replicas=3)
        finally:
            await bus.close()
    finally:
        for node in nodes:
            node.stop()
    assert info.config.num_replicas == 3
    assert info.cluster is not None and info.cluster.leader in CERT_HOSTS
    assert sorted([info.cluster.leader, *(r.name for r in info.cluster.replicas or [])]) == \
        CERT_HOSTS


async def _add_replicated_stream(bus: Bus, replicas: int) -> api.StreamInfo:
    """Creates an R3 stream the gateway role may create (its batch jobs stream's name),
    once the routes are up and JetStream has its meta leader (a few seconds)."""
    js = bus.client.jetstream()
    deadline = time.monotonic() + 30
    while True:
        try:
            await js.add_stream(api.StreamConfig(
                name="mesh-batch-jobs", subjects=["mesh.batch.jobs"], num_replicas=replicas))
            return await js.stream_info("mesh-batch-jobs")
        except (nats.js.errors.APIError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
