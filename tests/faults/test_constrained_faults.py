"""Structured outputs survive faults: a constrained stream whose worker is killed (its requests
are preempted, then resume on the restarted worker, which rebuilds each grammar matcher from
the tokens already generated) or whose scheduler is killed (its requests move to the other
engine, prompt + streamed tokens) ends with the text an undisturbed run gives, valid against
its schema."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from tests.faults.conftest import MODEL, busiest_engine, complete, wait_whole
from tests.faults.streams import StreamSet, post_json
from tests.faults.test_faults import RECOVERY_BOUND_S
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

# Long enough to be mid-stream when the fault comes; short strings so it always closes.
LIST = {"type": "array", "minItems": 8, "maxItems": 8,
        "items": {"type": "string", "minLength": 4, "maxLength": 16}}
PROMPTS = ["Eight fruits, as a JSON list:", "Eight cities, as a JSON list:",
           "Eight colors, as a JSON list:", "Eight animals, as a JSON list:"]


def constrained(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 160, "temperature": 0,
            "structured_outputs": {"json": LIST}}


@pytest.fixture(scope="module")
def undisturbed(fault_mesh: Mesh) -> list[str]:
    def run(prompt: str) -> str:
        status, _, body = post_json(f"{fault_mesh.base_url}/v1/completions",
                                    constrained(prompt))
        assert status == 200, body
        return body["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(run, PROMPTS))
    for text in texts:
        jsonschema.validate(json.loads(text), LIST)
    return texts


def assert_valid_and_unchanged(results: list[Any], undisturbed: list[str]) -> None:
    assert [r.outcome() for r in results] == ["completed (stop)"] * len(results)
    assert [r.text for r in results] == undisturbed
    for result in results:
        jsonschema.validate(json.loads(result.text), LIST)


def test_worker_killed_mid_constrained_stream(fault_mesh: Mesh, undisturbed: list[str]) -> None:
    streams = StreamSet(fault_mesh.base_url, [constrained(p) for p in PROMPTS])
    streams.wait_for_chunks(3)
    _, worker = busiest_engine(fault_mesh)
    fault_mesh.restart(worker)             # SIGKILL, then start again
    assert_valid_and_unchanged(streams.finish(RECOVERY_BOUND_S), undisturbed)
    wait_whole(fault_mesh)


def test_scheduler_killed_mid_constrained_stream(fault_mesh: Mesh,
                                                 undisturbed: list[str]) -> None:
    streams = StreamSet(fault_mesh.base_url, [constrained(p) for p in PROMPTS])
    streams.wait_for_chunks(3)
    scheduler, _ = busiest_engine(fault_mesh)
    fault_mesh.services[scheduler].stop(signal.SIGKILL)      # its requests move
    assert_valid_and_unchanged(streams.finish(RECOVERY_BOUND_S), undisturbed)
    fault_mesh.restart(scheduler)
    wait_whole(fault_mesh)
    assert complete(fault_mesh, "The mesh is whole again", 4)["choices"]
