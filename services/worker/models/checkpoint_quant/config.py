"""The checkpoint's quantization_config (config.json) -> the scheme that reads its tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.worker.models.checkpoint_quant.compressed_tensors import CompressedTensorsQuant
from services.worker.models.checkpoint_quant.gptq_awq import AWQQuant, GPTQQuant
from services.worker.models.checkpoint_quant.scheme import (
    CheckpointQuant, UnsupportedQuantizationError)

_METHOD_TO_SCHEME: dict[str, Any] = {
    "compressed-tensors": CompressedTensorsQuant,
    "gptq": GPTQQuant,
    "awq": AWQQuant,
}


def parse_quantization_config(config: dict[str, Any] | None) -> CheckpointQuant | None:
    """The scheme of a quantization_config, None for an unquantized checkpoint; a clear error
    naming what is supported for anything else."""
    if not config:
        return None
    method = config.get("quant_method")
    scheme = _METHOD_TO_SCHEME.get(method)
    if scheme is None:
        raise UnsupportedQuantizationError(f"quant_method {method!r}")
    return scheme.from_config(config)


def read_checkpoint_quant(model_dir: Path) -> CheckpointQuant | None:
    """The scheme named by model_dir/config.json (None without one, or unquantized)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    return parse_quantization_config(json.loads(path.read_text()).get("quantization_config"))
