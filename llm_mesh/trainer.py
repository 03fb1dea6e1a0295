"""The trainer's side of an RL loop against a running mesh (docs/rl.md): the gateway's sleep
mode and weight update endpoints, one call each.

    from llm_mesh.trainer import MeshTrainer

    mesh = MeshTrainer("http://127.0.0.1:8000", api_key=ADMIN_KEY)
    rollouts = ...                          # /v1/completions with logprobs, return_token_ids
    mesh.sleep(level=1)                     # the engines give their memory to the trainer
    train_step(policy, rollouts)
    mesh.wake_up()
    mesh.push_weights(policy, "/shared/ckpt/step-1", weight_version="step-1")

Every engine of the mesh takes the new weights or none does; requests under way finish on the
weights they started with.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx2 as httpx


class MeshAdminError(RuntimeError):
    """The gateway refused or failed an admin call; `status` is its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class MeshTrainer:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 1800.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers,
                                  timeout=timeout_s)

    def sleep(self, level: int = 1) -> None:
        """Level 1 keeps the weights in host memory outside the engines, level 2 drops them."""
        self._call("POST", "/sleep", params={"level": level})

    def wake_up(self, tags: Iterable[str] = ()) -> None:
        """Restores what `tags` name ("weights", "kv_cache"; none: both)."""
        self._call("POST", "/wake_up", params=[("tags", tag) for tag in tags])

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    def update_weights_from_disk(self, model_path: str | os.PathLike[str],
                                 weight_version: str | None = None) -> dict[str, Any]:
        """Every engine serves the checkpoint in `model_path` (a directory its workers can
        read: *.safetensors with the model's HF tensor names, config.json optional) from now
        on; the answer names the version and each engine's load and commit seconds."""
        body: dict[str, Any] = {"model_path": str(Path(model_path).resolve())}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._call("POST", "/update_weights_from_disk", json=body)

    def push_weights(self, weights: Any, directory: str | os.PathLike[str],
                     weight_version: str | None = None) -> dict[str, Any]:
        """Saves `weights` (a transformers model, or a state dict of HF-named tensors) into
        `directory` as safetensors, then has every engine serve them. The directory must stay
        readable while the engines serve it (a restarted worker and sleep level 2 read it)."""
        save_weights(weights, Path(directory))
        return self.update_weights_from_disk(directory, weight_version)

    def weight_version(self) -> str | None:
        """The version every engine serves ("default": the weights they started with), or
        None while they differ."""
        return self._call("GET", "/get_weight_version")["weight_version"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MeshTrainer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise MeshAdminError(response.status_code, message)
        return response.json() if response.content else None


def save_weights(weights: Any, directory: Path) -> None:
    """A transformers model through its own save_pretrained (config.json beside, tied weights
    once), or a state dict into one model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(weights, "save_pretrained"):
        weights.save_pretrained(directory, safe_serialization=True)
        return
    if not isinstance(weights, Mapping):
        raise TypeError("weights must be a transformers model or a state dict, not "
                        f"{type(weights).__name__}")
    from safetensors.torch import save_file   # torch only when a trainer saves tensors

    tensors: dict[str, Any] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in weights.items():
        # Tied weights (lm_head = embed_tokens) are one tensor: saved once, as HF does.
        if (key := (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())) not in seen:
            seen.add(key)
            tensors[name] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
