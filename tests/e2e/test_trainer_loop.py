"""An RL trainer's loop against the real mesh (issue 47), through the project's trainer client
(llm_mesh/trainer.py): rollouts, sleep level 1 while it trains (the worker's RSS drops by the
weights' size), wake up (same greedy output), then new weights pushed without a restart:
the embedded model with a merged LoRA delta, whose greedy output must equal HF's on the same
weights. The prefix cache is reset by the update and the kvstore serves no block computed
with the old weights; a request under way when the update comes finishes on the old weights;
a worker that restarts comes back on the new ones.

One mesh of its own: a kvstore beside it, its worker with --enable-sleep-mode."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from llm_mesh.trainer import MeshAdminError, MeshTrainer
from services.common.model_files import DEFAULT_MODEL, embedded_gguf_path, resolve_model
from tests.e2e.test_sleep_mode import KV_CACHE_BYTES, wait_for_kv_pages, worker_memory
from tests.faults.streams import poll
from tests.mesh import Mesh, http_post, metric_value, serving
from tests.reference import hf_model

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
# Long enough for four full blocks: what the prefix cache and the kvstore hold.
SHARED_PREFIX = ("You are a careful assistant. Answer in one short sentence, and say nothing "
                 "else at all. Question: which planet is the largest in our solar system, "
                 "and what is it mostly made of?")
MAX_TOKENS = 16
# Long enough to outlast the new weights' load (2.6 s on 2 cores; the request ~12 s), so the
# commit finds it under way.
IN_FLIGHT_TOKENS = 1024
LORA_RANK = 8


@pytest.fixture(scope="module")
def trainer_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = Mesh(Path(tmp_path_factory.mktemp("trainer-mesh")), namespace="trainer",
                with_kvstore=True, extra_args={
                    "worker": ["--enable-sleep-mode", "--kv-cache-memory", str(KV_CACHE_BYTES)]})
    with serving(mesh) as running:
        yield running


@pytest.fixture(scope="module")
def trainer(trainer_mesh: Mesh) -> Iterator[MeshTrainer]:
    with MeshTrainer(trainer_mesh.base_url) as client:
        yield client


@pytest.fixture(scope="module")
def policy() -> PreTrainedModel:
    """The embedded model after a training step: a rank-8 LoRA delta merged into every
    layer's q and v projections."""
    gguf = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(47)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.v_proj):
                out_features, in_features = linear.weight.shape
                a = torch.randn(LORA_RANK, in_features, generator=generator) * 0.05
                b = torch.randn(out_features, LORA_RANK, generator=generator) * 0.05
                linear.weight += b @ a
    return model


def prompt_ids(text: str) -> list[int]:
    _, tokenizer = hf_model()
    return tokenizer(text)["input_ids"]


def greedy_ids_of(model: PreTrainedModel, ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def complete(mesh: Mesh, ids: list[int], max_tokens: int = MAX_TOKENS,
             ignore_eos: bool = False) -> dict:
    status, body = http_post(f"{mesh.base_url}/v1/completions", {
        "model": DEFAULT_MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": ignore_eos, "return_token_ids": True}, timeout=300)
    assert status == 200, body
    return body


def output_ids(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def kvstore_metric(mesh: Mesh, name: str) -> float:
    _, body = mesh.services["kvstore"].get("/metrics")
    return metric_value(body.decode(), name)


def test_a_trainer_sleeps_wakes_and_pushes_new_weights(trainer_mesh: Mesh, trainer: MeshTrainer,
                                                       policy: PreTrainedModel,
                                                       tmp_path: Path) -> None:
    ids, shared = prompt_ids(PROMPT), prompt_ids(SHARED_PREFIX)
    assert trainer.weight_version() == "default"
    before = output_ids(complete(trainer_mesh, ids))

    # Sleep while the trainer trains: the worker gives the weights' memory back.
    wait_for_kv_pages(trainer_mesh)
    awake = worker_memory(trainer_mesh)["VmRSS"]
    trainer.sleep(level=1)
    assert trainer.is_sleeping()
    weights_bytes = (resolve_model(DEFAULT_MODEL).hf_dir / "model.safetensors").stat().st_size
    assert awake - worker_memory(trainer_mesh)["VmRSS"] >= weights_bytes
    trainer.wake_up()
    assert output_ids(complete(trainer_mesh, ids)) == before

    # The shared prompt's blocks are in the prefix cache and, reused once, in the kvstore.
    assert cached_tokens(complete(trainer_mesh, shared)) == 0
    assert cached_tokens(complete(trainer_mesh, shared)) > 0
    poll(lambda: kvstore_metric(trainer_mesh, "llm_mesh:kvstore_put_blocks_total")
         >= len(shared) // 16, 30, "the kvstore to take the shared prompt's blocks")
    old_in_flight = output_ids(complete(trainer_mesh, ids, IN_FLIGHT_TOKENS, ignore_eos=True))

    # New weights, while a request is under way.
    in_flight: list[dict] = []
    request = threading.Thread(target=lambda: in_flight.append(
        complete(trainer_mesh, ids, IN_FLIGHT_TOKENS, ignore_eos=True)))
    request.start()
    poll(lambda: trainer_mesh.scheduler_metric("vllm:num_requests_running") >= 1, 60,
         "the request to start running", interval_s=0.02)
    # A state dict, as RL frameworks gather it (this model, read from a GGUF, has no
    # save_pretrained of its own).
    answer = trainer.push_weights(policy.state_dict(), tmp_path / "step-1",
                                  weight_version="step-1")
    request.join(timeout=120)
    print(f"weight update, one engine: {answer['engines']}")
    assert answer["weight_version"] == "step-1"
    assert answer["engines"]["engine-0"]["requests_finished_first"] == 1
    assert trainer.weight_version() == "step-1"
    [finished] = in_flight
    assert output_ids(finished) == old_in_flight   # all of it on the old weights

    after = complete(trainer_mesh, ids)
    assert output_ids(after) == greedy_ids_of(policy, ids, MAX_TOKENS)
    assert output_ids(after) != before
    hits_before = trainer_mesh.scheduler_metric("vllm:external_prefix_cache_hits_total")
    fresh = complete(trainer_mesh, shared)
    assert cached_tokens(fresh) == 0   # neither the prefix cache nor the kvstore had it
    assert trainer_mesh.scheduler_metric("vllm:external_prefix_cache_hits_total") == hits_before
    assert output_ids(fresh) == greedy_ids_of(policy, shared, MAX_TOKENS)
    # The new weights' blocks are cached again from here on.
    assert cached_tokens(complete(trainer_mesh, shared)) > 0

    # The next training step sleeps again: the weights that come back are the new ones.
    trainer.sleep(level=1)
    trainer.wake_up()
    assert output_ids(complete(trainer_mesh, ids)) == output_ids(after)

    # A worker that restarts comes back on the new weights, not its checkpoint's.
    trainer_mesh.restart("worker")
    poll(lambda: _serves(trainer_mesh, trainer, "step-1"), 240,
         "the restarted worker to serve step-1")
    assert output_ids(complete(trainer_mesh, ids)) == output_ids(after)


def _serves(mesh: Mesh, trainer: MeshTrainer, version: str) -> bool:
    """Whether the engine answers a request and serves weights `version`."""
    status, _ = http_post(f"{mesh.base_url}/v1/completions", {
        "model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 1}, timeout=60)
    try:
        return status == 200 and trainer.weight_version() == version
    except MeshAdminError:   # no engine ready yet
        return False


def test_a_checkpoint_of_another_model_is_refused_and_nothing_changes(
        trainer_mesh: Mesh, trainer: MeshTrainer, tmp_path: Path) -> None:
    version = trainer.weight_version()
    ids = prompt_ids(PROMPT)
    before = output_ids(complete(trainer_mesh, ids))
    with pytest.raises(MeshAdminError) as missing:
        trainer.update_weights_from_disk(tmp_path / "nowhere")
    assert missing.value.status == 400 and "nowhere" in str(missing.value)

    other = tmp_path / "other-model"
    other.mkdir()
    hf_dir = resolve_model(DEFAULT_MODEL).hf_dir
    config = json.loads((hf_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    shutil.copy(hf_dir / "model.safetensors", other / "model.safetensors")
    with pytest.raises(MeshAdminError) as refused:
        trainer.update_weights_from_disk(other)
    assert refused.value.status == 400 and "num_hidden_layers" in str(refused.value)

    assert trainer.weight_version() == version
    assert output_ids(complete(trainer_mesh, ids)) == before
