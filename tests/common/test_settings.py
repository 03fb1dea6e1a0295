from dataclasses import dataclass

import pytest

from services.common.settings import (CommonSettings, build_settings, parse_settings,
                                      public_view, setting, to_argv)


@dataclass
class DemoSettings(CommonSettings):
    max_model_len: int = setting(0, "context")
    enable_prefix_caching: bool = setting(True, "cache")
    api_key: list[str] = setting([], "keys", secret=True)
    ratio: float = setting(0.5, "ratio")


def test_flags_beat_environment_which_beats_defaults() -> None:
    env = {"LLM_MESH_MAX_MODEL_LEN": "512", "LLM_MESH_RATIO": "0.25"}
    parsed = parse_settings(DemoSettings, ["--max-model-len", "1024"])
    assert parsed.max_model_len == 1024
    from_env = build_settings(DemoSettings, {}, env)
    assert from_env.max_model_len == 512 and from_env.ratio == 0.25
    assert build_settings(DemoSettings, {}, {}).max_model_len == 0


def test_booleans_lists_and_round_trip_through_argv() -> None:
    parsed = parse_settings(DemoSettings, ["--no-enable-prefix-caching", "--api-key", "a",
                                           "--api-key", "b", "--log-level", "debug"])
    assert parsed.enable_prefix_caching is False and parsed.api_key == ["a", "b"]
    assert parse_settings(DemoSettings, to_argv(parsed, DemoSettings)) == parsed
    env = build_settings(DemoSettings, {}, {"LLM_MESH_API_KEY": "x, y",
                                            "LLM_MESH_ENABLE_PREFIX_CACHING": "false"})
    assert env.api_key == ["x", "y"] and env.enable_prefix_caching is False


def test_bad_values_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_settings(DemoSettings, ["--max-model-len", "many"])
    with pytest.raises(SystemExit):
        parse_settings(DemoSettings, ["--log-level", "loud"])
    with pytest.raises(SystemExit):
        build_settings(DemoSettings, {}, {"LLM_MESH_ENABLE_PREFIX_CACHING": "perhaps"})


def test_secrets_are_masked_for_logs() -> None:
    settings = DemoSettings(api_key=["sk-secret"], nats_url="nats://user:pw@host:4222")
    view = public_view(settings)
    assert view["api_key"] == ["***"]
    assert view["nats_url"] == "nats://***@host:4222"
    assert "sk-secret" not in str(view) and "pw" not in str(view)
