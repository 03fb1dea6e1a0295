"""The chained draft passes built at once (chain_passes.py) are the one-token passes
prepare_step_batch builds one by one: same positions, slots (across a block boundary, into
scratch), seq lens and block tables, each pass over the rows still drafting."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.spec_decode.chain_passes import chain_passes
from services.worker.spec_decode.draft_input_batch import DraftInputBatch

BLOCK_SIZE = 4


def draft_batch() -> DraftInputBatch:
    """Rows 0..2 with 6, 7 and 3 computed tokens in blocks of their own, then scratch."""
    batch = DraftInputBatch(max_num_reqs=3, max_num_blocks_per_req=4, block_size=BLOCK_SIZE,
                            num_scratch_blocks=1, first_scratch_block=20)
    batch.token_ids = np.arange(3 * 16, dtype=np.int32).reshape(3, 16)
    batch.num_computed_tokens[:] = [6, 7, 3]
    batch.block_table[0, :3] = [5, 9, 20]
    batch.block_table[1, :3] = [2, 3, 21]
    batch.block_table[2, :2] = [7, 22]
    batch.num_blocks[:] = [3, 3, 2]
    return batch


def test_each_pass_is_the_one_prepare_step_batch_builds() -> None:
    rows, num_passes = np.array([1, 0, 2]), np.array([3, 2, 1])
    batch = draft_batch()
    built = chain_passes(batch, rows, num_passes, torch.device("cpu"))
    assert [p.num_rows for p in built] == [3, 2, 1]
    for j, chained in enumerate(built):
        active = rows[:chained.num_rows]
        batch.num_tokens[active] = batch.num_computed_tokens[active] + 1
        expected = batch.prepare(active, np.ones(len(active), dtype=np.int32),
                                 torch.device("cpu"))
        assert expected is not None
        assert torch.equal(chained.positions, expected.positions)
        for name in ("slot_mapping", "seq_lens", "block_table", "query_start_loc"):
            got, want = getattr(chained.attn, name), getattr(expected.attn, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert np.array_equal(chained.attn.seq_lens_cpu, expected.attn.seq_lens_cpu)
        assert (chained.attn.num_reqs, chained.attn.num_decodes) == (len(active), len(active))
        batch.num_computed_tokens[active] += 1
