"""The verifier: which of a step's draft tokens the target model accepts.

Every position a request samples at (its last known token and each draft) is sampled from
the target distribution exactly as without speculation (the sampler's temperature, top-k,
top-p, min-p, logit_bias; one uniform per position). Draft j is accepted when the token
sampled at its position equals it, and the request emits its accepted drafts plus the first
sampled token that differs (or, all accepted, the token after the last draft: the bonus).

This is rejection sampling for a point-mass draft distribution, as all drafts here are (a
draft model proposes its greedy tokens): sampling y ~ p and accepting draft x iff y == x
accepts with probability p(x), and on rejection y is distributed as p with x's probability
zeroed and renormalised (the residual max(p - q, 0), normalised, with q the point mass at
x). Every emitted token is therefore distributed as without speculation; greedy rows accept
exactly the argmax prefix.

NOTE (seeds): a seeded request draws its uniforms from its own generator, one per position,
in order. After verification its generator is set back and advanced by the tokens it emitted
only, so its k-th output token always uses the k-th uniform of its stream: seeded output
depends neither on how many drafts a step verified nor on the batch around it.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.runner.input_batch import InputBatch, concat_ranges
from services.worker.sampling.sampling_metadata import SamplingMetadata


class DraftVerifier:
    """One step's verification. Built before sampling (it reads the drafts and snapshots the
    seeded generators); `verify` after it."""

    def __init__(self, batch: InputBatch, rows: np.ndarray, num_drafts: np.ndarray,
                 md: SamplingMetadata) -> None:
        """rows: the sampling requests' rows; num_drafts: the drafts each verifies; md: the
        sampling metadata of their positions (1 + drafts per request, in order)."""
        self.num_drafts = num_drafts
        self.num_positions = num_drafts + 1
        self.first_position = np.cumsum(self.num_positions) - self.num_positions
        spec = np.flatnonzero(num_drafts)
        starts = batch.num_tokens[rows[spec]]
        draft_rows = np.repeat(rows[spec], num_drafts[spec])
        self.drafts = batch.token_ids[draft_rows, concat_ranges(starts, num_drafts[spec])]
        # Seeded requests that verify drafts: their generator and its state before sampling.
        self.seeded = {int(i): (generator, generator.get_state()) for i in spec.tolist()
                       if (generator := md.generators.get(int(self.first_position[i])))
                       is not None}

    def verify(self, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """sampled: the token at each position. Returns (the drafts each request accepted,
        a mask over positions of the tokens it emits)."""
        num_drafts = self.num_drafts
        checks = sampled[concat_ranges(self.first_position, num_drafts)]
        matches = np.zeros((len(num_drafts), int(num_drafts.max())), dtype=bool)
        request = np.repeat(np.arange(len(num_drafts)), num_drafts)
        matches[request, concat_ranges(np.zeros_like(num_drafts), num_drafts)] = (
            checks == self.drafts)
        num_accepted = np.cumprod(matches, axis=1).sum(axis=1)
        offsets = concat_ranges(np.zeros_like(num_drafts), self.num_positions)
        emitted = offsets <= np.repeat(num_accepted, self.num_positions)
        for i, (generator, state) in self.seeded.items():
            generator.set_state(state)
            for _ in range(int(num_accepted[i]) + 1):
                torch.rand(1, generator=generator, device=generator.device)
        return num_accepted, emitted
