"""Multi-LoRA on the worker (services/worker/lora/) against HF + PEFT, on a tiny random Llama.

Adapters are made in the test with peft, their A and B filled with seeded random values (PEFT
zero-inits B): all seven projections; q and v only with rslora (parts of the fused qkv); k,
gate and down at another rank. The ModelRunner, serving LoRA (--enable-lora), must give each
adapter's greedy output as PEFT's `generate` does, with logprobs within float tolerance; one
step mixing the three adapters and the base gives each row its solo output; with two slots
the adapters page in and out and outputs stay right. Adapters that do not fit are refused.
Requests name their adapter as the scheduler sends it (wire.LoraRequest: id and path).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from services.common import wire
from services.common.model_files import resolve_model
from services.common.packing import unpack_int32, unpack_strings
from services.worker.lora import BASE_LORA_ID, LoraError, LoraManager
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.driver import StepDriver
from tests.worker.tiny_models import TINY, save_tiny_model

MAX_NEW_TOKENS = 12
MAX_RANK = 16
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {   # lora_id -> LoraConfig fields
    1: dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
    2: dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    3: dict(r=16, lora_alpha=8, target_modules=["k_proj", "gate_proj", "down_proj"]),
}
PROMPTS = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (7, 23, 40, 11)]


def save_adapter(model_dir: Path, adapter_dir: Path, seed: int, std: float = 0.1,
                 **config) -> PeftModel:
    """A PEFT adapter on the model in `model_dir` with random non-zero A and B, saved."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(adapter_dir)
    return model.eval()


def peft_greedy(model: PeftModel | transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model("llama", directory)
    return directory


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[int, tuple[Path, PeftModel]]:
    """lora_id -> (adapter directory, the PEFT model: the reference)."""
    out = {}
    for lora_id, config in ADAPTERS.items():
        directory = tmp_path_factory.mktemp(f"adapter{lora_id}")
        out[lora_id] = directory, save_adapter(model_dir, directory, lora_id, **config)
    return out


@pytest.fixture(scope="module")
def expected(model_dir: Path, adapters: dict[int, tuple[Path, PeftModel]]
             ) -> dict[int, list[list[int]]]:
    """lora_id (BASE_LORA_ID: none) -> HF (+ PEFT) greedy output per prompt."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    models = {BASE_LORA_ID: base.eval()} | {i: model for i, (_, model) in adapters.items()}
    return {i: [peft_greedy(model, p) for p in PROMPTS] for i, model in models.items()}


def lora_runner(model_dir: Path, adapters: dict[int, tuple[Path, PeftModel]], max_loras: int,
                max_cpu_loras: int | None = None) -> tuple[ModelRunner, LoraManager]:
    """A runner serving LoRA, the adapters registered up front (as requests naming them
    would on first use), and its LoraManager."""
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_memory=2**20,
                                      max_num_seqs=8, enable_lora=True, max_loras=max_loras,
                                      max_lora_rank=MAX_RANK, max_cpu_loras=max_cpu_loras))
    assert runner.lora is not None
    manager = runner.lora.manager
    for lora_id, (path, _) in adapters.items():
        manager.add_adapter(lora_id, path)
    return runner, manager


def lora_request(lora_id: int, path: Path | None) -> wire.LoraRequest | None:
    if lora_id == BASE_LORA_ID:
        return None
    return wire.LoraRequest(lora_id=lora_id, name=f"adapter{lora_id}", path=str(path))


def generate(runner: ModelRunner, requests: list[tuple[int, list[int]]],
             paths: dict[int, Path], token_budget: int = 1 << 30,
             sampling: wire.SamplingParams | None = None) -> tuple[StepDriver, list[int]]:
    """Runs (lora_id, prompt) requests together; the driver and their handles."""
    driver = StepDriver(runner, token_budget)
    handles = [driver.add(prompt, MAX_NEW_TOKENS, sampling,
                          lora=lora_request(lora_id, paths.get(lora_id)))
               for lora_id, prompt in requests]
    driver.run()
    return driver, handles


def _paths(adapters: dict[int, tuple[Path, PeftModel]]) -> dict[int, Path]:
    return {lora_id: path for lora_id, (path, _) in adapters.items()}


def test_adapters_change_the_greedy_output(expected: dict[int, list[list[int]]]) -> None:
    """Else the comparisons below are weak: each adapter's output differs from the base's
    and the other adapters' on most prompts, and varies (a random model may echo a token)."""
    for i, outs in expected.items():
        for j, others in expected.items():
            if i != j:
                assert sum(a != b for a, b in zip(outs, others)) >= 3, (i, j)
        assert len({token for out in outs for token in out}) > len(PROMPTS), i


@pytest.mark.parametrize("lora_id", [BASE_LORA_ID, *ADAPTERS])
def test_each_adapter_matches_hf_peft(lora_id: int, model_dir: Path,
                                      adapters: dict[int, tuple[Path, PeftModel]],
                                      expected: dict[int, list[list[int]]]) -> None:
    runner, _ = lora_runner(model_dir, adapters, max_loras=3)
    driver, handles = generate(runner, [(lora_id, p) for p in PROMPTS], _paths(adapters),
                               token_budget=24, sampling=wire.SamplingParams(logprobs=0))
    assert [driver.requests[h].output_ids for h in handles] == expected[lora_id]
    # Logprobs of the tokens chosen, against the reference's over the same tokens.
    reference = adapters[lora_id][1] if lora_id != BASE_LORA_ID else None
    if reference is not None:
        req = driver.requests[handles[2]]
        with torch.no_grad():
            ref = reference(input_ids=torch.tensor([req.token_ids])).logits[0].log_softmax(-1)
        positions = torch.arange(req.num_prompt_tokens - 1, len(req.token_ids) - 1)
        want = ref[positions, torch.tensor(req.output_ids)]
        got = torch.tensor([lp for _, lp, *_ in req.logprobs])
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("token_budget", [1 << 30, 24])   # all at once; chunked with decodes
def test_one_step_mixing_adapters_and_base_gives_solo_outputs(
        token_budget: int, model_dir: Path, adapters: dict[int, tuple[Path, PeftModel]],
        expected: dict[int, list[list[int]]]) -> None:
    runner, _ = lora_runner(model_dir, adapters, max_loras=3)
    requests = [(lora_id, PROMPTS[i]) for i, lora_id in enumerate([1, BASE_LORA_ID, 2, 3])]
    driver, handles = generate(runner, requests, _paths(adapters), token_budget)
    for handle, (lora_id, prompt) in zip(handles, requests):
        assert driver.requests[handle].output_ids == expected[lora_id][PROMPTS.index(prompt)]


def test_two_slots_page_three_adapters(model_dir: Path,
                                       adapters: dict[int, tuple[Path, PeftModel]],
                                       expected: dict[int, list[list[int]]]) -> None:
    runner, manager = lora_runner(model_dir, adapters, max_loras=2, max_cpu_loras=2)
    assert manager.num_disk_loads == 3 and list(manager.host_adapters) == [2, 3]
    for lora_id in [1, 2, 3, 1, 3, 2]:
        driver, handles = generate(runner, [(lora_id, PROMPTS[0]),
                                            (BASE_LORA_ID, PROMPTS[1])], _paths(adapters))
        assert driver.requests[handles[0]].output_ids == expected[lora_id][0], lora_id
        assert driver.requests[handles[1]].output_ids == expected[BASE_LORA_ID][1]
        assert len(manager.lora_id_to_slot) <= 2 and lora_id in manager.lora_id_to_slot
    # Read from disk: 3 at registration, then at each placement of an adapter the host no
    # longer held (1, 2, 3, 1, then 2); the second 3 was still in its slot.
    assert manager.num_disk_loads == 3 + 5
    with pytest.raises(LoraError, match="over --max-loras 2"):
        manager.prepare_step(np.array([1, 2, 3]), np.array([1, 1, 1]))
    with pytest.raises(LoraError, match="unknown adapter lora_id 9"):
        manager.prepare_step(np.array([9]), np.array([1]))


def _adapter_on(model: transformers.PreTrainedModel, directory: Path, **config) -> Path:
    get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **config)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def manager(model_dir: Path) -> LoraManager:
    return lora_runner(model_dir, {}, max_loras=1)[1]


def test_adapter_first_named_by_a_request_loads_and_a_bad_one_is_rejected(
        model_dir: Path, adapters: dict[int, tuple[Path, PeftModel]],
        expected: dict[int, list[list[int]]], tmp_path: Path) -> None:
    """The worker reads an adapter the first time a request names it; a request naming a
    directory that holds no adapter is reported rejected, with why, and the others run."""
    runner, manager = lora_runner(model_dir, {}, max_loras=2)
    driver = StepDriver(runner)
    good = driver.add(PROMPTS[0], MAX_NEW_TOKENS, lora=lora_request(1, adapters[1][0]))
    bad = driver.add(PROMPTS[1], MAX_NEW_TOKENS,
                     lora=wire.LoraRequest(lora_id=7, name="missing", path=str(tmp_path)))
    out = driver.run_step()
    assert unpack_int32(out.rejected_handles).tolist() == [bad]
    [reason] = unpack_strings(out.rejected_reasons)
    assert "'missing' could not be loaded" in reason and str(tmp_path) in reason
    assert manager.lora_id_to_path == {1: adapters[1][0]}
    driver.requests.pop(bad)          # the scheduler ends it; the good one runs on
    driver.finished.append(bad)
    driver.run()
    assert driver.requests[good].output_ids == expected[1][0]


def test_adapter_over_max_rank_is_refused(manager: LoraManager, model_dir: Path,
                                          tmp_path: Path) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    path = _adapter_on(base, tmp_path, r=32, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="rank 32, over --max-lora-rank 16"):
        manager.add_adapter(1, path)
    assert 1 not in manager.lora_id_to_path


def test_adapter_on_unknown_module_is_refused(manager: LoraManager, model_dir: Path,
                                              tmp_path: Path) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    path = _adapter_on(base, tmp_path, r=4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match="lm_head"):
        manager.add_adapter(1, path)


def test_adapter_for_another_base_model_is_refused(manager: LoraManager,
                                                   tmp_path: Path) -> None:
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY,
                                                                      "hidden_size": 32}))
    path = _adapter_on(other, tmp_path, r=4, target_modules=["v_proj"])
    with pytest.raises(LoraError, match="another base model"):
        manager.add_adapter(1, path)


def test_dora_adapter_is_refused(manager: LoraManager, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        dict(peft_type="LORA", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])))
    with pytest.raises(LoraError, match="use_dora=True is not supported"):
        manager.add_adapter(1, tmp_path)


@pytest.mark.slow
def test_smollm2_adapter_and_base_in_one_step_match_hf_peft(tmp_path: Path) -> None:
    """The embedded SmolLM2-135M (GGUF blocks read for small steps, as the worker runs it)."""
    model_dir = resolve_model("").hf_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p)["input_ids"] for p in ("The capital of France is",
                                                   "def fibonacci(n):")]
    reference = save_adapter(model_dir, tmp_path, seed=7, std=0.05, r=8, lora_alpha=16,
                             target_modules=ALL_PROJECTIONS)
    with_adapter = [peft_greedy(reference, p) for p in prompts]
    with reference.disable_adapter():
        base = [peft_greedy(reference, p) for p in prompts]
    assert with_adapter != base
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, max_model_len=256,
                                      kv_cache_memory=32 * 2**20, max_num_seqs=4,
                                      enable_lora=True, max_lora_rank=MAX_RANK))
    requests = [(1, prompts[0]), (BASE_LORA_ID, prompts[0]), (1, prompts[1]),
                (BASE_LORA_ID, prompts[1])]
    driver, handles = generate(runner, requests, {1: tmp_path})
    outputs = [driver.requests[h].output_ids for h in handles]
    assert outputs == [with_adapter[0], base[0], with_adapter[1], base[1]]
