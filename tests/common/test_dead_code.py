"""No dead code: vulture finds nothing unused in the tree, beyond what frameworks use by name
(FastAPI routes, pydantic validators, pytest's names, and tests/common/dead_code_whitelist.py)."""

from __future__ import annotations

from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["services", "kernels", "llm_mesh", "benchmarks", "tests"]
GENERATED = ["*/services/common/wire/*", "*/services/common/wire_pb/*"]


def test_nothing_unused() -> None:
    scan = vulture.Vulture(
        ignore_names=["test_*", "pytestmark", "pytest_*"],
        ignore_decorators=["@app.*", "@router.*", "@field_validator", "@model_validator",
                           "@pytest.fixture", "@rule", "@invariant", "@initialize"])
    scan.scavenge([str(ROOT / p) for p in SCANNED]
                  + [str(ROOT / "tests/common/dead_code_whitelist.py")], exclude=GENERATED)
    unused = [item.get_report(add_size=False) for item in scan.get_unused_code(min_confidence=60)]
    assert not unused, "\n".join(unused)
