"""How an optional feature takes part in a step: LoRA (lora/), images (multimodal/),
speculative decoding (spec_decode/) and the KV connector (kv/) each subclass StepHooks.

The model runner keeps a list of the features it was built with and calls every hook of
each at its point in the step, so the step reads the same with any mix of them and has no
branch per feature (vLLM's model runner V2 keeps its features behind objects the same way).
A feature overrides the hooks it needs; the rest do nothing. In a step, in this order:

    remove_requests -> add_requests -> before_forward -> prepare_forward -> (forward, sample)
    -> after_sampling -> finish_step; then report, after a failed step too.

The forward pass's inputs are a single slot, not a list: TextInputs, or the images' hooks
that put embeddings in place of placeholder tokens (multimodal/runner_multimodal.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.common import wire_pb
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.step_batch import StepBatch


class StepHooks:
    def remove_requests(self, input_batch: InputBatch, handles: list[int]) -> None:
        """Before the rows of `handles` (finished or preempted requests) go."""

    def add_requests(self, input_batch: InputBatch, step: wire_pb.StepInput) -> None:
        """After the step's diffs are applied: its new requests hold their rows."""

    def before_forward(self, step: wire_pb.StepInput) -> None:
        """Before the step's batch is prepared; in every step, one that runs nothing too."""

    def prepare_forward(self, batch: StepBatch, input_batch: InputBatch) -> None:
        """Just before the forward pass over `batch`."""

    def after_sampling(self, input_batch: InputBatch, handles: np.ndarray, rows: np.ndarray,
                       out: wire_pb.StepOutput) -> None:
        """The requests of `handles` (at `rows`) sampled; `out` holds their tokens."""

    def finish_step(self, step: wire_pb.StepInput, out: wire_pb.StepOutput,
                    ran_forward: bool) -> None:
        """`out` is the step's answer; `ran_forward`: whether the step had tokens to run."""

    def report(self, out: wire_pb.StepOutput) -> None:
        """Adds to `out` the requests the feature refused since the last step."""

    def close(self) -> None:
        """The runner closes: release threads and connections."""


class TextInputs:
    """The forward pass's inputs without images: the model looks the token ids' embeddings
    up itself, at the batch's positions."""

    def prepare_inputs(self, batch: StepBatch,
                       _embed_input_ids: Callable[[torch.Tensor], torch.Tensor]
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        return None, batch.positions
