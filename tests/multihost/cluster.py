"""A mesh spread over hosts (hosts.py): a NATS node on every host, joined into one cluster
(routes between all of them, JetStream on each), and the mesh's services placed on hosts,
each given every node's URL (its own host's first; the client picks among them and fails
over to the others). Everything between hosts is TLS with certificates verified both ways:
clients to nodes and node to node, from one throwaway CA."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import trustme

from llm_mesh.embedded import nats_server_binary, wait_for_port
from llm_mesh.service_modules import SERVICE_MODULES
from tests.mesh import REPO_ROOT, ServiceProcess, http_get
from tests.multihost.hosts import Host
from tests.pki import issue

CLIENT_PORT, ROUTE_PORT, HEALTH_PORT_BASE = 4222, 6222, 9100


@dataclass(frozen=True)
class Pki:
    """The CA, and a client certificate every service (and the test) presents."""
    ca: trustme.CA
    files: Path

    def node_certificate(self, host: Host) -> tuple[str, str, str]:
        return issue(self.ca, host.ip, self.files, host.name)

    @property
    def client_certificate(self) -> tuple[str, str, str]:
        return issue(self.ca, "mesh-service", self.files, "client")

    def client_context(self) -> ssl.SSLContext:
        ca, cert, key = self.client_certificate
        context = ssl.create_default_context(cafile=ca)
        context.load_cert_chain(cert, key)
        return context


@dataclass
class NatsNode:
    host: Host
    peers: list[Host]
    store: Path
    pki: Pki
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"tls://{self.host.ip}:{CLIENT_PORT}"

    def start(self, timeout_s: float = 20.0) -> None:
        argv = [nats_server_binary(), "-c", str(self._config()),
                "-l", str(self.store / "nats-server.log")]
        self.process = subprocess.Popen(self.host.command(argv), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        wait_for_port(self.host.ip, CLIENT_PORT, timeout_s, self.process, "nats-server")

    def _config(self) -> Path:
        ca, cert, key = self.pki.node_certificate(self.host)
        tls = f'tls {{ cert_file: "{cert}", key_file: "{key}", ca_file: "{ca}", verify: true }}'
        routes = ", ".join(f'"tls://{p.ip}:{ROUTE_PORT}"' for p in self.peers)
        config = self.store / "nats.conf"
        config.write_text(f"""
server_name: {self.host.name}
listen: {self.host.ip}:{CLIENT_PORT}
jetstream {{ store_dir: "{self.store / 'jetstream'}" }}
{tls}
cluster {{
  name: mesh
  listen: {self.host.ip}:{ROUTE_PORT}
  routes: [{routes}]
  {tls}
}}
""")
        return config

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()


@dataclass
class HostService(ServiceProcess):
    """A mesh service run on a host; its health port answers on the host's address."""
    host: Host | None = None

    def start(self, env: dict[str, str]) -> None:
        assert self.host is not None
        log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", SERVICE_MODULES[self.kind or self.name], *self.argv,
                "--health-host", self.host.ip, "--health-port", str(self.health_port),
                "--log-format", "json"]
        self.process = subprocess.Popen(self.host.command(argv), stdout=log,
                                        stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        log.close()

    def get(self, path: str) -> tuple[int, bytes]:
        assert self.host is not None
        return http_get(f"http://{self.host.ip}:{self.health_port}{path}")


@dataclass
class SpreadMesh:
    workdir: Path
    pki: Pki
    nodes: dict[str, NatsNode] = field(default_factory=dict)      # host name -> its node
    services: dict[str, HostService] = field(default_factory=dict)
    gateway_url: str = ""

    def start_cluster(self, hosts: list[Host]) -> None:
        for host in hosts:
            node = NatsNode(host, [h for h in hosts if h != host], self.workdir / host.name,
                            self.pki)
            node.store.mkdir(parents=True, exist_ok=True)
            node.start()
            self.nodes[host.name] = node
        self.wait_replicated()

    def restart_node(self, host: Host) -> None:
        """Starts a killed node again and waits until it has rejoined the cluster."""
        self.nodes[host.name].start()
        self.wait_replicated()

    def wait_replicated(self, timeout_s: float = 60.0) -> None:
        """Until JetStream places a stream on every node and every stream has a leader and
        current replicas: a node that just (re)started has rejoined, and the mesh's R3
        streams answer again."""
        urls = [node.url for node in self.nodes.values()]

        async def probe() -> None:
            connection = await nats.connect(servers=urls, tls=self.pki.client_context(),
                                            connect_timeout=2, allow_reconnect=False)
            try:
                js = connection.jetstream()
                name = f"probe-{secrets.token_hex(4)}"
                await js.add_stream(name=name, subjects=[f"probe.{name}"],
                                    num_replicas=len(urls))
                await js.delete_stream(name)
                # Each of the mesh's streams has elected a leader again (one on the lost node
                # had none, and its API calls time out until it has).
                for info in await js.streams_info():
                    current = [p for p in (info.cluster.replicas or []) if p.current] \
                        if info.cluster else []
                    if info.cluster is None or not info.cluster.leader \
                            or len(current) + 1 < len(urls):
                        raise TimeoutError(f"stream {info.config.name} is not whole yet")
            finally:
                await connection.close()

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                asyncio.run(probe())
                return
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the NATS cluster did not recover: {exc!r}") from exc
                time.sleep(0.5)

    def nats_urls(self, host: Host) -> str:
        """Every node's URL, its own host's first."""
        own = self.nodes[host.name]
        return ",".join([own.url] + [n.url for n in self.nodes.values() if n is not own])

    def start_service(self, name: str, host: Host, args: list[str], kind: str = "") -> None:
        ca, cert, key = self.pki.client_certificate
        service = HostService(name, ["--nats-url", self.nats_urls(host), "--namespace", "mesh",
                                     "--jetstream-replicas", "3", "--nats-tls-ca-file", ca,
                                     "--nats-tls-cert-file", cert, "--nats-tls-key-file", key,
                                     *args],
                              self.workdir / f"{name}.log",
                              HEALTH_PORT_BASE + len(self.services), kind=kind, host=host)
        service.start({**os.environ, "PYTHONUNBUFFERED": "1"})
        self.services[name] = service

    def wait_ready(self, engines: int, timeout_s: float = 300.0) -> None:
        """Until the gateway is healthy (a tokenizer ready among the rest) and sees `engines`
        engines: a first request must not find the tokenizer still loading."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for service in self.services.values():
                if service.process is not None and service.process.poll() is not None:
                    raise RuntimeError(f"{service.name} exited:\n{service.log_tail()}")
            status, body = http_get(f"{self.gateway_url}/health")
            if status == 200 and json.loads(body)["services"].get("scheduler") \
                    == f"{engines} ready":
                return
            time.sleep(0.2)
        raise TimeoutError("the spread mesh did not become ready:\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in self.services.values())

    def stop(self) -> None:
        for service in self.services.values():
            if service.process is not None and service.process.poll() is None:
                service.process.kill()
                service.process.wait()
        for node in self.nodes.values():
            if node.process is not None and node.process.poll() is None:
                node.kill()
