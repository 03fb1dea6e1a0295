"""CUDA graphs for decode steps (cuda + triton backend only).

A decode step launches a few hundred small kernels; on a GPU their launch overhead, not the
math, sets the step time at small batches. At start-up we capture one graph per batch size
1, 2, 4, 8, 16, 32, ... up to max_num_seqs over static input buffers; a decode-only step
(every request has one query token) copies its inputs into the buffers, pads to the nearest
captured size and replays. Padding rows write no KV (slot -1) and attend over nothing
(seq_len 0). Mixed or prefill steps run eagerly.
"""

from __future__ import annotations

import bisect

import numpy as np
import structlog
import torch

from services.worker.attention.backend import AttentionBackend, CommonAttentionMetadata
from services.worker.models.llama import LlamaForCausalLM
from services.worker.runner.step_batch import StepBatch

log = structlog.get_logger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, and max_num_seqs itself."""
    sizes = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs}
    return sorted(sizes | {max_num_seqs})


class CudaGraphRunner:
    def __init__(self, model: LlamaForCausalLM, attn_backend: AttentionBackend,
                 max_num_seqs: int, max_num_blocks_per_req: int, device: torch.device):
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_num_blocks_per_req, dtype=torch.int32,
                                       device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # NOTE: largest first, so smaller graphs reuse the largest one's memory pool.
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: triton compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode", batch_sizes=self.sizes)

    def can_run(self, batch: StepBatch) -> bool:
        return batch.is_decode_only and batch.attn.num_reqs <= self.sizes[-1]

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states [num_reqs, hidden] of a decode-only batch."""
        n = batch.attn.num_reqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.attn.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(batch.attn.seq_lens)
        self.seq_lens[n:size].zero_()
        width = batch.attn.block_table.shape[1]
        self.block_table[:size].zero_()
        self.block_table[:n, :width].copy_(batch.attn.block_table)
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        common = CommonAttentionMetadata(
            num_reqs=size, num_actual_tokens=size, num_decodes=size, max_query_len=1,
            query_start_loc=self.query_start_loc[:size + 1],
            query_start_loc_cpu=np.arange(size + 1),
            seq_lens=self.seq_lens[:size], seq_lens_cpu=np.zeros(size, dtype=np.int64),
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size])
        metadata = self.attn_backend.build_metadata(common)
        return self.model.forward(self.input_ids[:size], self.positions[:size], metadata)
