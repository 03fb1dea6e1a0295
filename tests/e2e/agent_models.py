"""The objects agent libraries are asked for in tests/e2e/test_agent_libraries.py, shared with
tests/e2e/instructor_client.py (which runs in instructor's own venv: pydantic only here)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Fruit(BaseModel):
    name: str = Field(max_length=20)
    color: Color
    weight_grams: int = Field(ge=1, le=1000)
