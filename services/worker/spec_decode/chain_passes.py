"""The one-token passes that chain a draft head's drafts after its catch-up pass, built at
once without prepare_step_batch: pass j runs each row's j-th draft at the position after
the previous pass's, so its slot (block table), seq len and attention metadata follow from
the catch-up's and are uploaded in one go; the drafts themselves stay on the device.

Rows are ordered by their number of passes, most first, so each pass runs a prefix of them
(a row near max_model_len drafts fewer tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.spec_decode.draft_input_batch import DraftInputBatch


@dataclass
class ChainPass:
    num_rows: int               # the pass runs the chain's first num_rows rows
    positions: torch.Tensor     # int64 [num_rows]
    attn: CommonAttentionMetadata


def chain_passes(draft_batch: DraftInputBatch, rows: np.ndarray, num_passes: np.ndarray,
                 device: torch.device) -> list[ChainPass]:
    """The passes of `rows` (num_passes each, non-increasing), from their computed tokens:
    pass j runs position num_computed + j of each row still drafting, as a decode."""
    block_size = draft_batch.block_size
    first = draft_batch.num_computed_tokens[rows].astype(np.int64)
    positions = first[None, :] + np.arange(int(num_passes[0]))[:, None]   # [passes, rows]
    # NOTE: a row past its last pass reads the table's last column; its slot goes unused.
    width = draft_batch.block_table.shape[1]
    columns = np.minimum(positions // block_size, width - 1)
    slots = (draft_batch.block_table[rows[None, :], columns].astype(np.int64) * block_size
             + positions % block_size)
    seq_lens = positions + 1
    max_blocks = -(-int(seq_lens.max()) // block_size)
    on_device = torch.from_numpy(np.stack((positions, slots, seq_lens))).to(device)
    device_seq_lens = on_device[2].to(torch.int32)
    block_table = torch.from_numpy(draft_batch.block_table[rows, :max_blocks]).to(device)
    query_start_loc = np.arange(len(rows) + 1, dtype=np.int64)
    device_query_start_loc = torch.from_numpy(query_start_loc).to(device, torch.int32)
    num_rows = (num_passes[None, :] > np.arange(int(num_passes[0]))[:, None]).sum(axis=1)
    passes = []
    for j, n in enumerate(num_rows.tolist()):
        lens = seq_lens[j, :n]
        attn = CommonAttentionMetadata(
            num_reqs=n, num_actual_tokens=n, num_decodes=n, max_query_len=1,
            query_start_loc=device_query_start_loc[:n + 1],
            query_start_loc_cpu=query_start_loc[:n + 1],
            seq_lens=device_seq_lens[j, :n], seq_lens_cpu=lens,
            block_table=block_table[:n, :-(-int(lens.max()) // block_size)].contiguous(),
            slot_mapping=on_device[1, j, :n])
        passes.append(ChainPass(n, on_device[0, j, :n], attn))
    return passes
