"""Images on the worker (issue 19): the model runner's hooks that encode a request's images
and put their embeddings (and Qwen2-VL's M-RoPE positions) into its steps."""

from services.worker.multimodal.runner_multimodal import RunnerMultiModal, enable_multimodal

__all__ = ["RunnerMultiModal", "enable_multimodal"]
