"""What `llm-mesh up` hands each child: flags on the command line, secrets in the
environment (a command line is readable by every local user through ps)."""

from __future__ import annotations

from llm_mesh.launcher import service_argv
from services.common.settings import build_settings
from services.gateway.settings import GatewaySettings
from services.scheduler.settings import SchedulerSettings


def test_secrets_travel_in_the_environment_and_everything_else_as_flags() -> None:
    explicit = {"api_key": ["key-one", "key-two"], "port": 9000, "max_num_seqs": 64,
                "redis_url": "redis://:hunter2@10.0.0.5:6379/0", "enable_prefix_caching": False}
    argv, env = service_argv("gateway", explicit)
    assert argv == ["--port", "9000"]
    assert not any("key-" in arg or "hunter2" in arg for arg in argv)
    gateway = build_settings(GatewaySettings, {"port": 9000}, environ=env)
    assert gateway.api_key == ["key-one", "key-two"]

    argv, env = service_argv("scheduler", explicit)
    assert "hunter2" not in " ".join(argv)
    assert "--max-num-seqs" in argv and "--no-enable-prefix-caching" in argv
    scheduler = build_settings(SchedulerSettings, {}, environ=env)
    assert scheduler.redis_url == explicit["redis_url"]
