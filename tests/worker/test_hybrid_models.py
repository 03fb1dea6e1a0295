"""Each hybrid family (Bamba, services/worker/models/bamba.py; Nemotron-H, nemotron_h.py) against
transformers' own model class, from a tiny random checkpoint it saves (tiny_hybrids.py): prompt
logits, greedy decoding through the slots' recurrent step, a varlen batch (prefills of two lengths, then two decodes beside a prefill) against each
sequence alone, a prefill split in chunks against one shot. The attention layers run on the
engine's paged KV cache through the torch backend, as in the worker. All fp32 on CPU, where HF
runs its torch path (no mamba_ssm kernels), so the two must agree to rounding; and bf16 against
fp32. (test_hybrid_runner.py runs them through the model runner.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.attention import CommonAttentionMetadata, get_attention_backend_cls
from services.worker.kv.kv_cache import KVCacheSpec, allocate_kv_caches
from services.worker.models.config import ModelConfig, UnsupportedModelError
from services.worker.models.mamba2 import StateBatch
from services.worker.models.registry import model_class
from services.worker.models.weights import WeightSource
from tests.worker.tiny_hybrids import HYBRID_FAMILIES, save_tiny_nemotron_h

ATOL = 1e-4
NUM_SLOTS = 4
BLOCK_SIZE = 16
BLOCKS_PER_SLOT = 4   # 64 tokens a sequence


# Per family: each layer's mixer, in order.
MIXERS = {"bamba": ["Mamba2Mixer", "HybridAttention", "Mamba2Mixer", "Mamba2Mixer"],
          "nemotron_h": ["Mamba2Mixer", "HybridAttention", "ReluSquaredMLP", "Mamba2Mixer",
                         "ReluSquaredMLP", "Mamba2Mixer"]}


@pytest.fixture(scope="module", params=list(HYBRID_FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return path, HYBRID_FAMILIES[request.param][0](path)


class PagedHybrid:
    """The model with its paged KV (slot s owns blocks 1 + s * BLOCKS_PER_SLOT ...) and states."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        device = torch.device("cpu")
        config = ModelConfig.from_hf_dir(model_dir)
        self.attn = get_attention_backend_cls("torch", device)(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.head_dim ** -0.5, BLOCK_SIZE)
        self.model = model_class(config.model_type)(
            config, WeightSource(model_dir, dtype, device), self.attn,
            config.max_position_embeddings)
        self.kv_spec = KVCacheSpec(config.num_attention_layers, config.num_key_value_heads,
                                   config.head_dim, BLOCK_SIZE, dtype)
        self.reset()

    def reset(self) -> None:
        self.model.bind_kv_caches(allocate_kv_caches(
            self.kv_spec, 1 + NUM_SLOTS * BLOCKS_PER_SLOT, torch.device("cpu")))
        self.states = self.model.allocate_states(NUM_SLOTS)

    def run(self, seqs: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """One forward pass over (slot, new tokens, tokens already in the slot) per sequence:
        each sequence's logits [its tokens, vocab]. Runs them decodes first, as the worker."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][1]) != 1)
        slots = [seqs[i][0] for i in order]
        tokens = [seqs[i][1] for i in order]
        computed = np.array([seqs[i][2] for i in order])
        batch = StateBatch.from_query_lens(slots, [len(t) for t in tokens], computed.tolist())
        positions = np.concatenate([np.arange(c, c + len(t)) for c, t in zip(computed, tokens)])
        slot_of_token = np.repeat(slots, [len(t) for t in tokens])
        blocks = 1 + slot_of_token * BLOCKS_PER_SLOT + positions // BLOCK_SIZE
        query_start_loc = np.array(batch.query_start_loc)
        seq_lens = computed + np.diff(query_start_loc)
        block_table = 1 + np.array(slots)[:, None] * BLOCKS_PER_SLOT + np.arange(BLOCKS_PER_SLOT)
        common = CommonAttentionMetadata(
            num_reqs=len(seqs), num_actual_tokens=len(positions),
            num_decodes=sum(len(t) == 1 for t in tokens), max_query_len=max(map(len, tokens)),
            query_start_loc=torch.from_numpy(query_start_loc).int(),
            query_start_loc_cpu=query_start_loc, seq_lens=torch.from_numpy(seq_lens).int(),
            seq_lens_cpu=seq_lens, block_table=torch.from_numpy(block_table).int(),
            slot_mapping=torch.from_numpy(blocks * BLOCK_SIZE + positions % BLOCK_SIZE))
        self.model.set_step_states(self.states, batch)
        hidden = self.model.forward(torch.tensor([t for ts in tokens for t in ts]),
                                    torch.from_numpy(positions), self.attn.build_metadata(common))
        logits = self.model.compute_logits(hidden)
        by_order = [logits[batch.rows(i)] for i in range(batch.num_seqs)]
        return [by_order[order.index(i)] for i in range(len(seqs))]


@pytest.fixture(scope="module")
def mesh_model(checkpoint: tuple[Path, torch.nn.Module]) -> PagedHybrid:
    return PagedHybrid(checkpoint[0], torch.float32)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_reads_the_checkpoint(checkpoint, mesh_model: PagedHybrid) -> None:
    model_config = ModelConfig.from_hf_dir(checkpoint[0])
    config = mesh_model.model.config
    assert config.mamba.head_dim == 16 and config.mamba.num_groups == 2
    assert config.dt_limit == (0.0, float("inf"))   # JSON's {"__float__": "Infinity"}
    assert model_config.hybrid_attention_layers == (1,)
    assert [type(layer.mixer).__name__ for layer in mesh_model.model.layers] == MIXERS[
        model_config.model_type]
    assert mesh_model.kv_spec.num_layers == 1


def test_nemotron_h_moe_layers_are_refused(tmp_path: Path) -> None:
    save_tiny_nemotron_h(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layers_block_type"][2] = "moe"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="MoE layers"):
        PagedHybrid(tmp_path, torch.float32)


def test_prompt_logits_match_hf(checkpoint, mesh_model: PagedHybrid) -> None:
    prompt = _prompt(21, seed=1)
    mesh_model.reset()
    (got,) = mesh_model.run([(2, prompt, 0)])
    with torch.no_grad():
        want = checkpoint[1](torch.tensor([prompt]), logits_to_keep=0).logits[0]
    assert (got - want).abs().max() < ATOL


def test_greedy_decode_matches_hf_generate(checkpoint, mesh_model: PagedHybrid) -> None:
    prompt, num_new = _prompt(11, seed=2), 16
    with torch.no_grad():
        want = checkpoint[1].generate(torch.tensor([prompt]), max_new_tokens=num_new,
                                      do_sample=False)[0, len(prompt):].tolist()
    mesh_model.reset()
    (logits,) = mesh_model.run([(1, prompt, 0)])
    got = [int(logits[-1].argmax())]
    while len(got) < num_new:   # one token at a time through the recurrent step
        (logits,) = mesh_model.run([(1, got[-1:], len(prompt) + len(got) - 1)])
        got.append(int(logits[-1].argmax()))
    assert got == want


def test_varlen_batch_equals_each_sequence_alone(mesh_model: PagedHybrid) -> None:
    long, short, third = _prompt(13, seed=3), _prompt(5, seed=4), _prompt(6, seed=6)
    mesh_model.reset()
    alone = [mesh_model.run([(0, long, 0)])[0], mesh_model.run([(1, short, 0)])[0],
             mesh_model.run([(2, third, 0)])[0]]
    alone_next = [mesh_model.run([(0, [7], 13)])[0], mesh_model.run([(1, [8], 5)])[0]]
    # The first two prompts batched in other slots; slot 2 is dirtied first, so a new sequence
    # must ignore what its slot holds.
    mesh_model.reset()
    mesh_model.run([(2, _prompt(9, seed=5), 0)])
    batched = mesh_model.run([(3, long, 0), (2, short, 0)])
    # Then one step of two decodes (one batched recurrent step) beside a prefill.
    batched += mesh_model.run([(3, [7], 13), (1, third, 0), (2, [8], 5)])
    want = [alone[0], alone[1], alone_next[0], alone[2], alone_next[1]]
    for got, expected in zip(batched, want, strict=True):
        assert (got - expected).abs().max() < ATOL


def test_chunked_prefill_equals_one_shot(mesh_model: PagedHybrid) -> None:
    prompt = _prompt(21, seed=7)
    mesh_model.reset()
    (one_shot,) = mesh_model.run([(0, prompt, 0)])
    # Chunks off the scan's chunk size, one shorter than the conv's K-1 = 3 inputs of state.
    chunked, start = [], 0
    for length in (10, 2, 9):
        chunked += mesh_model.run([(1, prompt[start:start + length], start)])
        start += length
    assert (torch.cat(chunked) - one_shot).abs().max() < ATOL
    # NOTE: a later layer's conv state holds activations of O(1) after several layers' rounding.
    for state in mesh_model.states:
        assert torch.allclose(state.ssm_states[1], state.ssm_states[0], atol=1e-5)
        assert torch.allclose(state.conv_states[1], state.conv_states[0], atol=1e-5)


def test_bf16_model_tracks_fp32(checkpoint, mesh_model: PagedHybrid) -> None:
    """bf16 weights and conv states over an fp32 SSM state: a prefill and a decode step stay
    near the fp32 logits (a loose bound: bf16 rounding, which varies with the CPU's kernels)."""
    bf16 = PagedHybrid(checkpoint[0], torch.bfloat16)
    prompt = _prompt(13, seed=8)
    logits = {}
    for model in (mesh_model, bf16):
        model.reset()
        logits[model] = torch.cat([model.run([(0, prompt, 0)])[0],
                                   model.run([(0, [9], len(prompt))])[0]])
    assert bf16.states[0].ssm_states.dtype == torch.float32
    assert bf16.states[0].conv_states.dtype == torch.bfloat16
    assert (logits[bf16] - logits[mesh_model]).abs().max() < 0.3
