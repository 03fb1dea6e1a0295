"""What a proposer does for the Speculator: drafts for the rows that just sampled, and the
requests that come and go (a proposer that keeps per-row state needs both); a proposer that
drafts from the target's hidden states also learns which step they are of."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from services.worker.runner.input_batch import InputBatch
from services.worker.runner.step_batch import StepBatch


class Proposer(ABC):
    @abstractmethod
    def propose(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        """Writes drafts for `rows` (distinct) into the batch, right after each row's known
        tokens, and sets their num_draft_tokens. Returns the number of drafts per row."""

    def add_requests(self, rows: list[int]) -> None:
        """Requests took `rows` (new, resumed, or sent again after a reset)."""

    def remember(self, batch: InputBatch, rows: list[int]) -> None:
        """The requests of `rows` leave the batch (their tokens are still there)."""

    def prepare_forward(self, step: StepBatch) -> None:
        """The target's forward pass is about to run `step` (propose follows, same step)."""
