"""instructor against the mesh, run by the interpreter of its own venv (.venv-agents:
instructor cannot share one with the openai client the tests use). Prints the object
instructor returned, as JSON. Run from the repository root as a module
(`python -m tests.e2e.instructor_client`)."""

from __future__ import annotations

import argparse

import instructor
from openai import OpenAI

from tests.e2e.agent_models import Fruit

MODES = {"json_schema": instructor.Mode.JSON_SCHEMA, "tools": instructor.Mode.TOOLS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=tuple(MODES), required=True)
    args = parser.parse_args()
    client = instructor.from_openai(OpenAI(base_url=args.base_url, api_key="unused"),
                                    mode=MODES[args.mode])
    fruit = client.chat.completions.create(
        model=args.model, response_model=Fruit, max_retries=0, max_tokens=96, temperature=0,
        messages=[{"role": "user", "content": "Describe an apple."}])
    assert isinstance(fruit, Fruit)
    print(fruit.model_dump_json())


if __name__ == "__main__":
    main()
