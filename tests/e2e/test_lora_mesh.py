"""Multi-LoRA end to end: an engine started with --enable-lora joins the running mesh under a
model name of its own; adapters made with peft (random non-zero weights) are loaded at run
time through POST /v1/load_lora_adapter, listed by /v1/models with their parent, and picked
by model name: through the official openai client, each adapter's greedy output (and the
base's, in the same batch) equals HF + PEFT's. An unknown or unloaded adapter is a 404 like a
model; an adapter whose base model's engines serve no LoRA is a 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import transformers
from peft import PeftModel

from services.common.model_files import resolve_model
from tests.mesh import Mesh
from tests.worker.test_lora import ALL_PROJECTIONS, save_adapter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("lora_engine")]

LORA_MODEL = "smollm2-lora"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12
ADAPTERS = {"sql-lora": dict(seed=7, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
            "tone-lora": dict(seed=8, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                         "down_proj"])}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PeftModel]]:
    model_dir = resolve_model("").hf_dir
    out = {}
    for name, config in ADAPTERS.items():
        directory = tmp_path_factory.mktemp(name)
        out[name] = directory, save_adapter(model_dir, directory, std=0.05, **config)
    return out


@pytest.fixture(scope="module")
def expected(adapters: dict[str, tuple[Path, PeftModel]]) -> dict[str, list[str]]:
    """Model name -> HF (+ PEFT) greedy completion text per prompt."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("").hf_dir)

    def complete(model: transformers.PreTrainedModel) -> list[str]:
        texts = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
            texts.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                          skip_special_tokens=True))
        return texts

    result = {name: complete(model) for name, (_, model) in adapters.items()}
    reference = next(iter(adapters.values()))[1]
    with reference.disable_adapter():
        result[LORA_MODEL] = complete(reference)
    return result


@pytest.fixture(scope="module")
def lora_engine(mesh: Mesh) -> Iterator[None]:
    mesh.add_engine("lora", scheduler_args=["--served-model-name", LORA_MODEL],
                    worker_args=["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"])
    yield
    mesh.remove_service("scheduler-lora")
    mesh.remove_service("worker-lora")
    mesh.wait_gateway_sees_engines()


def _post(url: str, body: dict) -> tuple[int, str]:
    """The status and text of a JSON POST (vLLM's LoRA endpoints answer plain text)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _load(mesh: Mesh, name: str, path: Path, base: str = LORA_MODEL) -> tuple[int, str]:
    return _post(f"{mesh.base_url}/v1/load_lora_adapter",
                 {"lora_name": name, "lora_path": str(path), "base_model_name": base})


def _greedy(client: openai.OpenAI, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].text


def test_adapters_load_list_and_answer_as_hf_peft(
        mesh: Mesh, client: openai.OpenAI,
        adapters: dict[str, tuple[Path, PeftModel]], expected: dict[str, list[str]]) -> None:
    assert expected["sql-lora"] != expected[LORA_MODEL] != expected["tone-lora"]
    for name, (path, _) in adapters.items():
        assert _load(mesh, name, path) == (200, f"Success: LoRA adapter '{name}' added "
                                                f"successfully.")
    status, body = _load(mesh, "sql-lora", adapters["sql-lora"][0])
    assert status == 400 and "already been loaded" in json.loads(body)["error"]["message"]
    listed = {m.id: m for m in client.models.list().data}
    assert listed["sql-lora"].parent == LORA_MODEL                 # type: ignore[attr-defined]
    assert listed["sql-lora"].root == str(adapters["sql-lora"][0])  # type: ignore[attr-defined]
    # Both adapters and the base, concurrently: steps mix their rows.
    jobs = [(model, i) for model in [*ADAPTERS, LORA_MODEL] for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _greedy(client, job[0], PROMPTS[job[1]]), jobs))
    assert answers == [expected[model][i] for model, i in jobs]


def test_unknown_and_unloaded_adapters_are_404(
        mesh: Mesh, client: openai.OpenAI,
        adapters: dict[str, tuple[Path, PeftModel]]) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        _greedy(client, "no-such-lora", PROMPTS[0])
    assert unknown.value.code == "model_not_found"
    _load(mesh, "short-lived", adapters["tone-lora"][0])
    assert _greedy(client, "short-lived", PROMPTS[0])
    status, body = _post(f"{mesh.base_url}/v1/unload_lora_adapter",
                         {"lora_name": "short-lived"})
    assert (status, body) == (200, "Success: LoRA adapter 'short-lived' removed "
                                            "successfully.")
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "short-lived", PROMPTS[0])
    status, _ = _post(f"{mesh.base_url}/v1/unload_lora_adapter", {"lora_name": "short-lived"})
    assert status == 404


def test_bad_adapters_are_400(mesh: Mesh, client: openai.OpenAI, model_name: str,
                              adapters: dict[str, tuple[Path, PeftModel]],
                              tmp_path: Path) -> None:
    status, body = _load(mesh, "empty", tmp_path)
    assert status == 400 and "no LoRA adapter at" in json.loads(body)["error"]["message"]
    # The default engine runs without --enable-lora.
    assert _load(mesh, "on-plain-engine", adapters["sql-lora"][0], base=model_name)[0] == 200
    with pytest.raises(openai.BadRequestError, match="--enable-lora"):
        _greedy(client, "on-plain-engine", PROMPTS[0])
