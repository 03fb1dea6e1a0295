"""The LoRA adapters this frontend serves, by model name (vLLM's --lora-modules and its
/v1/load_lora_adapter): a request whose `model` names an adapter runs on its base model's
engines with the adapter (wire.LoraRequest), and /v1/models lists it with its parent.

An adapter's lora_id is derived from its name and path, so every gateway replica and batch
runner gives it the same id without talking to each other, and the engines' prefix caches
(whose block hashes carry the id) keep each adapter's KV apart. The adapters loaded at run
time live in this process: with several gateway replicas, load them on each (as with
vLLM's servers), or list them in --lora-modules.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common import wire
from services.frontend.errors import ApiError, invalid

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str = ""   # "": the model the engines serve, when they serve one

    @property
    def lora_id(self) -> int:
        digest = hashlib.sha256(f"{self.name}\n{self.path}".encode()).digest()
        return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF or 1   # int32, > 0

    def request(self) -> wire.LoraRequest:
        return wire.LoraRequest(lora_id=self.lora_id, name=self.name, path=self.path)


def parse_lora_module(spec: str) -> LoraModule:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if spec.lstrip().startswith("{"):
        try:
            fields = json.loads(spec)
            return LoraModule(fields["name"], fields["path"], fields.get("base_model_name", ""))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--lora-modules {spec!r}: not a JSON object with name and path "
                             f"({exc})") from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: expected name=path")
    return LoraModule(name, path)


def check_adapter_dir(path: str) -> None:
    """A 400 unless `path` holds a PEFT LoRA adapter, as far as this process can tell (the
    engines' workers check it against the model when a request first uses it)."""
    config_path = Path(path) / ADAPTER_CONFIG
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise invalid(f"no LoRA adapter at {path}: cannot read {ADAPTER_CONFIG} ({exc})",
                      param="lora_path") from None
    peft_type = config.get("peft_type", "LORA") if isinstance(config, dict) else None
    if peft_type != "LORA":
        raise invalid(f"the adapter at {path} is {peft_type!r}, not a LoRA adapter",
                      param="lora_path")


class LoraRegistry:
    def __init__(self, modules: list[LoraModule] | None = None) -> None:
        self._modules: dict[str, LoraModule] = {}
        for module in modules or []:
            self.add(module)

    @classmethod
    def from_specs(cls, specs: list[str]) -> LoraRegistry:
        return cls([parse_lora_module(spec) for spec in specs])

    def add(self, module: LoraModule) -> None:
        if module.name in self._modules:
            raise invalid(f"The lora adapter '{module.name}' has already been loaded.",
                          param="lora_name")
        self._modules[module.name] = module

    def remove(self, name: str) -> None:
        if self._modules.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name", code="model_not_found")

    def __iter__(self) -> Iterator[LoraModule]:
        return iter(sorted(self._modules.values(), key=lambda m: m.name))

    def __contains__(self, name: str) -> bool:
        return name in self._modules

    def resolve(self, model: str, served_models: list[str]) -> tuple[str, wire.LoraRequest | None]:
        """The base model a request for `model` runs on, and its adapter (None: `model` is
        not an adapter's name)."""
        module = self._modules.get(model)
        if module is None:
            return model, None
        parent = self.parent(module, served_models)
        if parent is None:
            raise invalid(f"the engines serve several models ({', '.join(served_models)}): "
                          f"give the adapter '{module.name}' a base_model_name", param="model")
        return parent, module.request()

    @staticmethod
    def parent(module: LoraModule, served_models: list[str]) -> str | None:
        """The model the adapter runs on: its base_model_name, else the one model served
        ("" while none is ready: a request waits for an engine, then 503s); None when the
        engines serve several."""
        if module.base_model_name:
            return module.base_model_name
        if len(served_models) <= 1:
            return served_models[0] if served_models else ""
        return None
