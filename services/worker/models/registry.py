"""Which model class runs an HF config's model_type."""

from __future__ import annotations

from services.worker.models.bamba import BambaForCausalLM
from services.worker.models.gemma import GemmaForCausalLM
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM
from services.worker.models.nemotron_h import NemotronHForCausalLM
from services.worker.models.phi3 import Phi3ForCausalLM

CausalLM = LlamaForCausalLM | BambaForCausalLM | NemotronHForCausalLM

_MODEL_TYPE_TO_CLASS: dict[str, type[CausalLM]] = {
    "bamba": BambaForCausalLM,           # a hybrid: Mamba2 layers beside attention
    "nemotron_h": NemotronHForCausalLM,  # a hybrid: Mamba2, attention and MLP-only layers
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen2MoeForCausalLM,   # Qwen3's attention (q/k norms), no shared expert
}


def model_class(model_type: str) -> type[CausalLM]:
    """The class for a model_type config.py accepts (the Llama family's by default)."""
    return _MODEL_TYPE_TO_CLASS.get(model_type, LlamaForCausalLM)
