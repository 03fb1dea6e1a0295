"""End-to-end fixtures: an OpenAI client on the mesh, and HF transformers as the reference."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.mesh import Mesh


@pytest.fixture(scope="session")
def client(mesh: Mesh) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
