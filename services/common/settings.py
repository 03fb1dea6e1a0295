"""Typed settings: one dataclass per service, read from CLI flags and environment variables.

A field `max_model_len` is the flag `--max-model-len` and the variable
`LLM_MESH_MAX_MODEL_LEN`; a flag beats the variable, which beats the default. Booleans get
`--x` / `--no-x` (vLLM's spelling). Shared groups (CommonSettings, ModelSettings,
EngineSettings) are inherited, so `llm-mesh up` can accept the union of every service's
flags and hand each service exactly the ones it declares.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.common.model_files import DEFAULT_MODEL
from services.common.speculative_config import SpeculativeConfig, parse_speculative_config
from services.common.timing import INSTANCE_TIMEOUT_S, check_liveness_timeout

ENV_PREFIX = "LLM_MESH_"
S = TypeVar("S")


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None,
            secret: bool = False) -> Any:
    """A settings field: its default, its --help text, allowed values, and whether to hide it
    from logs."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "secret": secret}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class CommonSettings:
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS server URL, or a comma-separated "
                            "list of a cluster's nodes (credentials allowed: "
                            "nats://user:pass@host:port)", secret=True)
    namespace: str = setting("mesh", "Subject namespace; meshes sharing one NATS server need "
                             "distinct namespaces")
    jetstream_replicas: int = setting(
        1, "Copies of each JetStream stream and bucket the mesh creates (batch jobs, KV "
        "events, stored responses): 3 on a NATS cluster of 3 or more nodes, to outlive one")
    nats_connect_timeout_s: float = setting(
        60.0, "How long to wait for NATS at start-up before exiting with the reason")
    nats_tls_ca_file: str = setting(
        "", "CA bundle (PEM) that signed the NATS server's certificate: connects over TLS "
        "(a tls:// URL without it trusts the system's CAs)")
    nats_tls_cert_file: str = setting(
        "", "This service's client certificate (PEM) for a NATS server that verifies clients")
    nats_tls_key_file: str = setting("", "The client certificate's private key (PEM)")
    nats_inbox_prefix: str = setting(
        "_INBOX", "Prefix of the subjects this service receives replies on; give each NATS "
        "user its own, and let it subscribe only to that, so no service reads another's "
        "replies")
    instance_id: str = setting("", "This instance's id (default: <service>-<random>)")
    health_host: str = setting("127.0.0.1", "Bind address of /health, /ready and /metrics")
    health_port: int = setting(0, "Port of /health, /ready and /metrics (0: any free port)")
    log_level: str = setting("info", "Log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("auto", "Log format (auto: console on a terminal, else JSON)",
                              choices=("auto", "json", "console"))
    drain_timeout_s: float = setting(30.0, "On SIGTERM, how long to finish in-flight work")


@dataclass
class LivenessSettings:
    """When a silent instance counts as gone, for every service that acts on others'
    heartbeats (gateway, batch runner, tokenizer): one flag, one default
    (services/common/timing.py)."""
    instance_timeout_s: float = setting(
        INSTANCE_TIMEOUT_S, "An instance whose heartbeat is older than this is gone: a "
        "gateway moves (or fails) the requests a lost tokenizer or scheduler held; a "
        "tokenizer drops a lost gateway's requests and aborts them in their engines")

    def __post_init__(self) -> None:
        check_liveness_timeout("--instance-timeout-s", self.instance_timeout_s)


@dataclass
class ModelSettings:
    model: str = setting(DEFAULT_MODEL, "Model: the embedded SmolLM2-135M-Instruct, a local HF "
                         "directory (config.json + safetensors) or a .gguf file")
    served_model_name: str = setting("", "Name clients use for the model (default: from --model)")


@dataclass
class EngineSettings(ModelSettings):
    engine_id: str = setting("engine-0", "Engine this scheduler / worker belongs to")
    max_model_len: int = setting(0, "Longest prompt + output in tokens (0: the model's)")
    block_size: int = setting(16, "Tokens per KV cache block")
    max_num_seqs: int = setting(256, "Most requests in one step's batch")
    max_num_batched_tokens: int = setting(
        128, "Token budget of one step (decodes + prefill chunks); smaller keeps inter-token "
        "latency low while prompts prefill. 128 suits CPU workers (bf16, 32 streams: ITL P99 "
        "117 ms at 128, 280 ms at 512; benchmarks.md section 10); on an accelerator, where "
        "a chunk costs about a decode step, raise it (vLLM: 8192)")
    seed: int = setting(0, "Random seed for unseeded sampling")
    step_transport: str = setting(
        "auto", "How a scheduler sends steps to its worker: auto (a local socket when both "
        "run on one host and network namespace, NATS otherwise) or nats (always NATS)",
        choices=("auto", "nats"))
    speculative_config: str = setting(
        "", "Speculative decoding, as vLLM's JSON (empty: off): method ngram (prompt lookup), "
        "suffix, draft_model with a `model` of the target's tokenizer, eagle3 with a "
        "`model` naming an EAGLE-3 head's directory, or mtp (the target checkpoint's own "
        "MTP layer, MiMo's layout), e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'. "
        "Greedy output is unchanged and sampling keeps the target distribution")

    def __post_init__(self) -> None:
        parse_speculative_config(self.speculative_config)   # a bad flag stops the start

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_type(tp: Any) -> Any:
    """int | None -> int; list[str] -> list."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(tp) or tp


def _parse_value(tp: Any, raw: str) -> Any:
    base = _base_type(tp)
    if base is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if base is list:
        return [item.strip() for item in raw.split(",") if item.strip()]
    return base(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type, seen: set[str] | None = None) -> None:
    """Adds one flag per field of the settings dataclass `cls` (skipping names in `seen`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if seen is not None:
            if f.name in seen:
                continue
            seen.add(f.name)
        base = _base_type(hints[f.name])
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}]"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction,
                                **kwargs)
        elif base is list:
            parser.add_argument(flag_name(f.name), action="append", **kwargs)
        else:
            parser.add_argument(flag_name(f.name), type=lambda raw, tp=hints[f.name]:
                                _parse_value(tp, raw), choices=f.metadata.get("choices"),
                                **kwargs)


def build_settings(cls: type[S], explicit: Mapping[str, Any],
                   environ: Mapping[str, str] | None = None) -> S:
    """Flag values in `explicit` beat LLM_MESH_* variables, which beat defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in explicit:
            values[f.name] = explicit[f.name]
        elif env_name(f.name) in environ:
            try:
                values[f.name] = _parse_value(hints[f.name], environ[env_name(f.name)])
            except ValueError as exc:
                raise SystemExit(f"invalid {env_name(f.name)}: {exc}") from exc
    try:
        return cls(**values)
    except ValueError as exc:
        raise SystemExit(f"invalid settings: {exc}") from exc


def parse_settings(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None,
                   description: str | None = None) -> S:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    return build_settings(cls, vars(parser.parse_args(argv)))


def to_argv(settings: Any, cls: type) -> list[str]:
    """Flags that reproduce the non-default values of `settings` for the fields of `cls`."""
    argv: list[str] = []
    defaults = cls()
    names = {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(settings):
        if f.name not in names:
            continue
        value = getattr(settings, f.name)
        if value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        elif isinstance(value, list):
            for item in value:
                argv += [flag_name(f.name), str(item)]
        elif value is not None:
            argv += [flag_name(f.name), str(value)]
    return argv


def public_view(settings: Any) -> dict[str, Any]:
    """The settings as a dict for a start-up log line, with secrets masked."""
    view = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.metadata.get("secret") and value:
            value = _mask(value)
        view[f.name] = value
    return view


def _mask(value: Any) -> Any:
    if isinstance(value, list):
        return ["***"] * len(value)
    text = str(value)
    if "://" in text and "@" in text:  # keep the host of a URL, hide its credentials
        scheme, rest = text.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return text if "://" in text else "***"
