"""An engine whose worker runs two tensor-parallel ranks (--tensor-parallel-size 2), added to
the running mesh under a model name of its own: through the gateway and the openai client its
greedy answers equal the one-rank engine's, and stopping the worker ends its follower rank."""

from __future__ import annotations

import json
import os

import openai
import pytest

from tests.mesh import Mesh

pytestmark = pytest.mark.slow

TP_MODEL = "smollm2-tp2"
PROMPTS = ["Name three rivers of Europe.", "What is 17 times 3?",
           "Write one sentence about autumn."]


def greedy(client: openai.OpenAI, model: str) -> list[str]:
    return [client.chat.completions.create(
        model=model, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": p}]).choices[0].message.content or ""
        for p in PROMPTS]


def test_a_two_rank_engine_answers_as_a_one_rank_engine(mesh: Mesh, client: openai.OpenAI,
                                                        model_name: str) -> None:
    mesh.add_engine("tp", scheduler_args=["--served-model-name", TP_MODEL],
                    worker_args=["--tensor-parallel-size", "2"])
    worker = mesh.services["worker-tp"]
    try:
        assert TP_MODEL in [m.id for m in client.models.list().data]
        assert greedy(client, TP_MODEL) == greedy(client, model_name)
        started = next(json.loads(line) for line in worker.log_path.read_text().splitlines()
                       if "tensor parallel ranks started" in line)
    finally:
        mesh.remove_service("scheduler-tp")
        assert mesh.remove_service("worker-tp") == 0
        mesh.wait_gateway_sees_engines()
    [follower] = started["follower_pids"]
    with pytest.raises(ProcessLookupError):
        os.kill(follower, 0)
