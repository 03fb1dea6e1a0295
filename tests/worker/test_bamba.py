"""Bamba (services/worker/models/bamba.py) against transformers' own BambaForCausalLM, from a
tiny random checkpoint it saves: prompt logits, greedy decoding through the slots' recurrent
step, a varlen batch (prefills of two lengths, then two decodes beside a prefill) against each
sequence alone, a prefill split in chunks against one shot. All fp32 on CPU, where HF runs its
torch path (no mamba_ssm kernels), so the two must agree to rounding; and bf16 against fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.models.bamba import BambaConfig, BambaForCausalLM
from services.worker.models.mamba2 import Mamba2State, StateBatch

ATOL = 1e-4
NUM_SLOTS = 4
MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A 4-layer Bamba (attention at layer 1; 8 Mamba heads in 2 groups; a scan chunk of 8
    tokens, so prompts span several) saved with safetensors, and the HF model itself."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BambaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        initializer_range=0.1, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(config).eval()
    with torch.no_grad():
        # NOTE: HF initializes norms to one, D and dt_bias to one, A_log to log(1..H): noise on
        # every parameter keeps a wrong index or a missing term from hiding behind a constant.
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("bamba")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def mesh_model(checkpoint: tuple[Path, torch.nn.Module]) -> BambaForCausalLM:
    return BambaForCausalLM.from_pretrained(checkpoint[0], torch.float32, torch.device("cpu"))


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: BambaForCausalLM, seqs: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
    """One forward pass over (slot, new tokens, tokens already in the slot) per sequence: each
    sequence's logits [its tokens, vocab]."""
    batch = StateBatch.from_query_lens([slot for slot, _, _ in seqs],
                                       [len(tokens) for _, tokens, _ in seqs],
                                       [computed for _, _, computed in seqs])
    input_ids = torch.tensor([t for _, tokens, _ in seqs for t in tokens])
    logits = model.compute_logits(model.forward(input_ids, batch))
    return [logits[batch.rows(i)] for i in range(batch.num_seqs)]


def _fresh_states(model: BambaForCausalLM) -> None:
    model.bind_states(model.allocate_states(NUM_SLOTS, MAX_SEQ_LEN))


def test_config_reads_the_checkpoint(checkpoint, mesh_model: BambaForCausalLM) -> None:
    config = BambaConfig.from_dir(checkpoint[0])
    assert config.attn_layer_indices == (1,) and config.mamba.head_dim == 16
    assert config.dt_limit == (0.0, float("inf"))   # JSON's {"__float__": "Infinity"}
    assert [layer.is_attention for layer in mesh_model.layers] == [False, True, False, False]


def test_prompt_logits_match_hf(checkpoint, mesh_model: BambaForCausalLM) -> None:
    prompt = _prompt(21, seed=1)
    _fresh_states(mesh_model)
    (got,) = _run(mesh_model, [(2, prompt, 0)])
    with torch.no_grad():
        want = checkpoint[1](torch.tensor([prompt]), logits_to_keep=0).logits[0]
    assert (got - want).abs().max() < ATOL


def test_greedy_decode_matches_hf_generate(checkpoint, mesh_model: BambaForCausalLM) -> None:
    prompt, num_new = _prompt(11, seed=2), 16
    with torch.no_grad():
        want = checkpoint[1].generate(torch.tensor([prompt]), max_new_tokens=num_new,
                                      do_sample=False)[0, len(prompt):].tolist()
    _fresh_states(mesh_model)
    (logits,) = _run(mesh_model, [(1, prompt, 0)])
    got = [int(logits[-1].argmax())]
    while len(got) < num_new:   # one token at a time through the recurrent step
        (logits,) = _run(mesh_model, [(1, got[-1:], len(prompt) + len(got) - 1)])
        got.append(int(logits[-1].argmax()))
    assert got == want


def test_varlen_batch_equals_each_sequence_alone(mesh_model: BambaForCausalLM) -> None:
    long, short, third = _prompt(13, seed=3), _prompt(5, seed=4), _prompt(6, seed=6)
    _fresh_states(mesh_model)
    alone = [_run(mesh_model, [(0, long, 0)])[0], _run(mesh_model, [(1, short, 0)])[0],
             _run(mesh_model, [(2, third, 0)])[0]]
    alone_next = [_run(mesh_model, [(0, [7], 13)])[0], _run(mesh_model, [(1, [8], 5)])[0]]
    # The first two prompts batched in other slots; slot 2 is dirtied first, so a new sequence
    # must ignore what its slot holds.
    _fresh_states(mesh_model)
    _run(mesh_model, [(2, _prompt(9, seed=5), 0)])
    batched = _run(mesh_model, [(3, long, 0), (2, short, 0)])
    # Then one step of two decodes (one batched recurrent step) beside a prefill.
    batched += _run(mesh_model, [(3, [7], 13), (1, third, 0), (2, [8], 5)])
    want = [alone[0], alone[1], alone_next[0], alone[2], alone_next[1]]
    for got, expected in zip(batched, want, strict=True):
        assert (got - expected).abs().max() < ATOL


def test_chunked_prefill_equals_one_shot(mesh_model: BambaForCausalLM) -> None:
    prompt = _prompt(21, seed=7)
    _fresh_states(mesh_model)
    (one_shot,) = _run(mesh_model, [(0, prompt, 0)])
    # Chunks off the scan's chunk size, one shorter than the conv's K-1 = 3 inputs of state.
    chunked, start = [], 0
    for length in (10, 2, 9):
        chunked += _run(mesh_model, [(1, prompt[start:start + length], start)])
        start += length
    assert (torch.cat(chunked) - one_shot).abs().max() < ATOL
    for state in mesh_model.states:
        if isinstance(state, Mamba2State):
            assert torch.allclose(state.ssm_states[1], state.ssm_states[0], atol=1e-5)
            assert torch.allclose(state.conv_states[1], state.conv_states[0], atol=1e-6)


def test_bf16_model_tracks_fp32(checkpoint, mesh_model: BambaForCausalLM) -> None:
    """bf16 weights and conv states over an fp32 SSM state: a prefill and a decode step stay
    near the fp32 logits (a loose bound: bf16 rounding, which varies with the CPU's kernels)."""
    bf16 = BambaForCausalLM.from_pretrained(checkpoint[0], torch.bfloat16, torch.device("cpu"))
    prompt = _prompt(13, seed=8)
    logits = {}
    for model in (mesh_model, bf16):
        _fresh_states(model)
        logits[model] = torch.cat([_run(model, [(0, prompt, 0)])[0],
                                   _run(model, [(0, [9], len(prompt))])[0]])
    assert bf16.states[0].ssm_states.dtype == torch.float32
    assert bf16.states[0].conv_states.dtype == torch.bfloat16
    assert (logits[bf16] - logits[mesh_model]).abs().max() < 0.3
