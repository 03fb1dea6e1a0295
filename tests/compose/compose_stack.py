"""The compose deployment run for real (`make test-compose`): a Docker engine, the base images
compose/ names, the project image built from this checkout, and the mesh under a project
name of its own, removed with its volumes at the end.

Where Docker Hub cannot be reached, the base images are the offline stand-ins that
../shared/tools/compose_standins.sh builds (LLM_MESH_COMPOSE_STANDINS names another
folder), and where the Dockerfile's torch index cannot be reached the image builds against
the loopback index that script serves (its compose-offline.override.yml).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.compose.model import COMPOSE_DIR, MAIN, compose_binary
from tests.mesh import REPO_ROOT

BASE_IMAGES = ("python:3.11-slim", "nats:2.15-alpine", "valkey/valkey:9.1-alpine")
TORCH_INDEX = "https://download.pytorch.org/whl/cpu/torch/"   # the Dockerfile's default
STANDINS = Path(os.environ.get("LLM_MESH_COMPOSE_STANDINS",
                               REPO_ROOT.parent / "shared" / "tools"))
DEBIAN_MIRROR = "http://deb.debian.org/debian"   # for debootstrap, unless MIRROR is set


def run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
        cwd: Path = COMPOSE_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                          env=env, cwd=cwd, check=False)


def require_docker() -> None:
    info = run(["docker", "info", "--format", "{{.ServerVersion}}"], 30)
    assert info.returncode == 0, (
        f"no Docker engine answers ({info.stderr.strip()}): install one "
        f"(apt-get install -y docker.io; debootstrap too where the stand-ins are built) and "
        f"start it (dockerd &, as root)")


def _has_image(image: str) -> bool:
    return run(["docker", "image", "inspect", image], 30).returncode == 0


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def _standins(*args: str) -> None:
    script = STANDINS / "compose_standins.sh"
    assert script.exists(), (f"{script} not found: pull the base images yourself, or set "
                             f"LLM_MESH_COMPOSE_STANDINS to the folder that holds it")
    done = run(["bash", str(script), *args], 1800,
               env={**os.environ, "MIRROR": os.environ.get("MIRROR", DEBIAN_MIRROR)})
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout}{done.stderr}"


class ComposeStack:
    """compose/docker-compose.yml as project `project`, its API on `gateway_port`."""

    def __init__(self, project: str, gateway_port: int) -> None:
        self.project = project
        self.gateway_port = gateway_port
        self.files = [MAIN]
        self.serving_torch_index = False   # this run started the stand-ins' index server

    def prepare(self) -> None:
        """Base images (pulled, else stand-ins) and the torch index the build will use."""
        missing = [image for image in BASE_IMAGES if not _has_image(image)]
        if any(run(["docker", "pull", image], 600).returncode != 0 for image in missing):
            _standins()
        if not _reachable(TORCH_INDEX):
            self.serving_torch_index = not _reachable("http://127.0.0.1:8765/simple/")
            _standins("serve")
            self.files.append(STANDINS / "compose-offline.override.yml")

    def release(self) -> None:
        """Stops what prepare() started (the index server), nothing else."""
        if self.serving_torch_index:
            _standins("stop")

    def compose(self, *args: str, timeout_s: float = 600) -> str:
        argv = [compose_binary(), "--project-name", self.project, "--env-file", os.devnull]
        for path in self.files:
            argv += ["-f", str(path)]
        done = run([*argv, *args], timeout_s,
                   env={**os.environ, "GATEWAY_PORT": str(self.gateway_port)})
        assert done.returncode == 0, f"docker compose {' '.join(args)}:\n{done.stderr[-4000:]}"
        return done.stdout

    def containers(self) -> list[dict[str, object]]:
        """`docker compose ps -a`, one dict per container (Service, State, Health, ...)."""
        out = self.compose("ps", "--all", "--format", "json", timeout_s=60)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def wait_healthy(self, timeout_s: float, services: set[str] | None = None) -> float:
        """Seconds until every container (or those of `services`) is healthy; fails at
        once, with its log, on one that exited or restarts."""
        started = time.monotonic()
        while True:
            containers = [c for c in self.containers()
                          if services is None or c["Service"] in services]
            for c in containers:
                assert c["State"] not in ("exited", "restarting", "dead"), \
                    f"{c['Service']} is {c['State']}:\n{self.logs(str(c['Service']))[-4000:]}"
            if containers and all(c["Health"] == "healthy" for c in containers):
                return time.monotonic() - started
            assert time.monotonic() - started < timeout_s, \
                f"not healthy after {timeout_s:.0f} s: " \
                f"{ {c['Service']: c['Health'] or c['State'] for c in containers} }"
            time.sleep(1)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", "--no-log-prefix", service, timeout_s=60)

    def image_size_bytes(self, image: str) -> int:
        done = run(["docker", "image", "inspect", "--format", "{{.Size}}", image], 30)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    def volumes(self) -> list[str]:
        done = run(["docker", "volume", "ls", "--quiet", "--filter",
                    f"label=com.docker.compose.project={self.project}"], 30)
        return done.stdout.split()
