"""compose/prometheus/prometheus.yml scrapes every mesh service of every compose variant on
the port that serves its /metrics, once: the gateway's API port (its own series and every
engine's), each other service's health port; the schedulers' engine series are dropped
there (the gateway's target has them), so no series counts twice."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.compose.model import COMPOSE_DIR, MAIN, VARIANTS, load, mesh_services, run_compose

CONFIG = COMPOSE_DIR / "prometheus" / "prometheus.yml"
JOBS = {job["job_name"]: job for job in yaml.safe_load(CONFIG.read_text())["scrape_configs"]}


def scraped() -> dict[str, list[tuple[str, int]]]:
    """Compose service name -> (job, port) of each scrape that finds it."""
    found: dict[str, list[tuple[str, int]]] = {}
    for name, job in JOBS.items():
        for sd in job["dns_sd_configs"]:
            for service in sd["names"]:
                found.setdefault(service, []).append((name, sd["port"]))
    return found


def drops(job: dict[str, Any], metric: str) -> bool:
    return any(rule["action"] == "drop" and rule["source_labels"] == ["__name__"]
               and re.fullmatch(rule["regex"], metric)
               for rule in job.get("metric_relabel_configs", []))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mesh_service_is_scraped_once_on_its_metrics_port(variant: str) -> None:
    files, profiles = VARIANTS[variant]
    for svc in mesh_services(load(files, profiles)):
        environment = svc.environment
        port = int(environment["LLM_MESH_PORT"] if svc.kind == "gateway"
                   else environment["LLM_MESH_HEALTH_PORT"])
        jobs = scraped().get(svc.name, [])
        assert len(jobs) == 1 and jobs[0][1] == port, (svc.name, jobs)


def test_only_the_schedulers_targets_drop_the_engine_series() -> None:
    """The gateway's target carries them; every other service's own series are kept."""
    for service, jobs in scraped().items():
        for job, _ in jobs:
            for metric in ("vllm:spec_decode_num_drafts_total",
                           "llm_mesh:engine_step_seconds_bucket"):
                assert drops(JOBS[job], metric) == service.startswith("scheduler"), \
                    (service, job, metric)


def test_the_monitoring_profile_runs_prometheus_with_this_config() -> None:
    prometheus = load([MAIN], ["monitoring"])["services"]["prometheus"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in \
        prometheus["volumes"]
    assert "prometheus" not in load([MAIN])["services"]   # not without the profile
    result = run_compose([MAIN], ["monitoring"], "config", "-q")
    assert result.returncode == 0, result.stderr
