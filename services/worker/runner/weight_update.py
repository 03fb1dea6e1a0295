"""Weight updates without a restart: an RL trainer's new policy, served by the running worker
(POST /update_weights_from_disk; the scheduler's side: services/scheduler/weight_updates.py).

Two phases, so every engine of a mesh takes the new weights or none does:
- load: the new checkpoint is read and built into a second model beside the one serving, in
  a thread of its own while steps go on (the update costs the engine no step time but the
  swap); a checkpoint that does not fit the model (its config differs, a tensor is missing)
  fails here, and nothing changes.
- commit: between two steps (the scheduler has let the requests in flight finish, so none
  mixes versions), the staged model replaces the one serving, over the same KV tensors.
  The KV blocks' fingerprint takes the new version in, so the kvstore never serves a block
  computed with other weights.
- discard: another engine failed its load; the staged model is dropped.

NOTE: the loaded weights and the staged ones are both in memory until the commit (twice the
weights' bytes, briefly): the price of an update that cannot leave an engine half-updated.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import structlog
import torch

from services.worker.models.config import ModelConfig
from services.worker.runner.model_runner import ModelRunner

log = structlog.get_logger(__name__)

DEFAULT_WEIGHT_VERSION = "default"   # the weights a worker started with (SGLang's name)
# What a checkpoint must share with the serving model for its weights to drop in.
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "tie_word_embeddings", "attention_bias", "qk_norm", "moe")


class WeightUpdateError(ValueError):
    """A weight update the worker refuses: the checkpoint does not fit, or nothing is staged."""


@dataclass
class _Staged:
    model: torch.nn.Module
    model_dir: Path
    version: str


def versioned_fingerprint(base: str, version: str) -> str:
    """The KV fingerprint of `base`'s model serving weights `version`: unchanged for the
    weights it started with, so the kvstore's blocks of those stay valid across restarts."""
    if version == DEFAULT_WEIGHT_VERSION:
        return base
    return hashlib.sha256(f"{base}|weights={version}".encode()).hexdigest()[:24]


def unsupported_reason(runner: ModelRunner) -> str | None:
    """Why this worker cannot swap its weights, or None."""
    if runner.parallel is not None:
        return "weight updates work with one rank (not with --tensor-parallel-size > 1)"
    if runner.lora is not None:
        return "weight updates work without --enable-lora (adapters are set into the model)"
    if runner.multimodal is not None:
        return "weight updates work with text models (not a vision tower's weights)"
    return None


class WeightUpdates:
    """The weights a worker serves, and the new ones it stages (vLLM's update_weights)."""

    def __init__(self, runner: ModelRunner):
        self._runner = runner
        self._base_fingerprint = runner.kv_fingerprint
        self.version = DEFAULT_WEIGHT_VERSION
        self._staged: _Staged | None = None

    def load(self, model_dir: Path, version: str) -> float:
        """Builds `model_dir`'s weights beside the serving model; returns the seconds it took.
        Runs beside steps, never in the step thread."""
        if reason := unsupported_reason(self._runner):
            raise WeightUpdateError(reason)
        if not version or version == DEFAULT_WEIGHT_VERSION:
            raise WeightUpdateError(f"give the new weights a version other than "
                                    f"{DEFAULT_WEIGHT_VERSION!r}")
        _check_fits(self._runner.model_config, model_dir)
        started = time.perf_counter()
        self._staged = None   # a new load replaces an older staged one
        try:
            with torch.inference_mode():
                model = self._runner.build_model(model_dir)
        except (KeyError, FileNotFoundError, RuntimeError) as exc:
            raise WeightUpdateError(f"{model_dir} does not load into the serving model: "
                                    f"{exc}") from exc
        self._staged = _Staged(model, model_dir, version)
        seconds = time.perf_counter() - started
        log.info("new weights loaded beside the serving ones", model_dir=str(model_dir),
                 weight_version=version, seconds=round(seconds, 2))
        return seconds

    def commit(self) -> float:
        """Serves the staged weights from the next step on. In the step thread, between
        steps, with no request in flight."""
        staged = self._staged
        if staged is None:
            raise WeightUpdateError("no weights are loaded to commit (load_weights first)")
        started = time.perf_counter()
        runner = self._runner
        runner.swap_model(staged.model)
        # Sleep mode reloads (and level 1 copies) the weights the worker serves from here on.
        runner.config = replace(runner.config, model_dir=staged.model_dir)
        runner.kv_fingerprint = versioned_fingerprint(self._base_fingerprint, staged.version)
        if runner.kv_connector is not None:
            runner.kv_connector.transfer.fingerprint = runner.kv_fingerprint
        self.version = staged.version
        self._staged = None
        seconds = time.perf_counter() - started
        log.info("serving new weights", weight_version=self.version,
                 kv_fingerprint=runner.kv_fingerprint, seconds=round(seconds, 3))
        return seconds

    def discard(self) -> None:
        if self._staged is not None:
            log.info("staged weights dropped", weight_version=self._staged.version)
        self._staged = None


def _check_fits(serving: ModelConfig, model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise WeightUpdateError(f"{model_dir} is not a directory the worker can read")
    if not any(model_dir.glob("*.safetensors")):
        raise WeightUpdateError(f"no .safetensors weights in {model_dir}")
    if not (model_dir / "config.json").is_file():
        return   # weights only: they must fit the serving model's own config
    new = ModelConfig.from_hf_dir(model_dir)
    names = {f.name for f in fields(ModelConfig)}
    differ = [f"{name}: {getattr(new, name)!r} (serving {getattr(serving, name)!r})"
              for name in _SHAPE_FIELDS if name in names
              and getattr(new, name) != getattr(serving, name)]
    if differ:
        raise WeightUpdateError(f"{model_dir} holds another model than the one serving: "
                                + "; ".join(differ))
