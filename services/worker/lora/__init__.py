"""Multi-LoRA on the worker: adapters in PEFT format (adapter.py), the batched LoRA op
(ops.py; kernels/triton_lora.py on GPUs), the LoRA-capable linear (lora_linear.py), slots and
host-memory paging (lora_manager.py), enable_lora to wrap a loaded model (lora_model.py), and the runner's hooks
(runner_lora.py).
docs/lora.md says what works and what is left."""

from services.worker.lora.adapter import LoraError
from services.worker.lora.lora_manager import BASE_LORA_ID, LoraManager
from services.worker.lora.lora_model import enable_lora
from services.worker.lora.runner_lora import RunnerLora

__all__ = ["BASE_LORA_ID", "LoraError", "LoraManager", "RunnerLora", "enable_lora"]
