"""The layering of the code base holds (tests/common/import_rules.py says the rules), and the
checker catches a planted violation of each rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.import_rules import import_cycles, layering_violations

ROOT = Path(__file__).resolve().parents[2]


def test_the_tree_keeps_every_layering_rule() -> None:
    services = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}
    assert {"gateway", "batch", "tokenizer", "scheduler", "worker", "kvstore"} <= services
    violations = layering_violations(ROOT)
    assert not violations, "\n".join(violations)


def test_no_import_cycle_anywhere() -> None:
    cycles = import_cycles(ROOT)
    assert not cycles, "\n".join(cycles)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    packages = ["services", "services/common", "services/gateway", "services/batch",
                "services/tokenizer", "services/frontend", "services/scheduler",
                "services/scheduler/core", "kernels", "llm_mesh"]
    for package in packages:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    for name in ("services/common/block_hash.py", "services/common/wire.py",
                 "services/gateway/app.py", "services/batch/runner.py",
                 "services/tokenizer/service.py", "services/frontend/client.py",
                 "services/scheduler/service.py", "services/scheduler/settings.py",
                 "services/scheduler/core/pool.py", "kernels/ops.py", "llm_mesh/launcher.py"):
        (tmp_path / name).write_text("")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


PLANTED = [
    ("services/batch/runner.py", "from services.gateway.app import create_app\n",
     "a service imports only common"),
    ("services/gateway/app.py", "import services.batch.runner\n",
     "a service imports only common"),
    ("services/common/wire.py", "from services.gateway import app\n",
     "common imports no service"),
    ("services/scheduler/core/pool.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from services.scheduler.service import x\n", "the engine core imports only"),
    ("services/scheduler/core/pool.py", "from services.common import wire\n",
     "the engine core imports only"),
    ("kernels/ops.py", "def build():\n    from services.common.block_hash import h\n",
     "kernels stand on nothing"),
    ("services/tokenizer/service.py", "from services.frontend.client import c\n",
     "a service imports only common"),
    ("services/frontend/client.py", "from services.scheduler.service import s\n",
     "the frontend imports only common"),
    ("services/common/wire.py", "from services.frontend import client\n",
     "common imports no service"),
    ("llm_mesh/launcher.py", "from services.scheduler.service import SchedulerService\n",
     "llm_mesh imports of services only common and their settings"),
    ("services/scheduler/service.py", "from llm_mesh.launcher import main\n",
     "import nothing of llm_mesh"),
]


@pytest.mark.parametrize("path,source,rule", PLANTED)
def test_a_planted_violation_is_caught(tmp_path: Path, path: str, source: str,
                                       rule: str) -> None:
    clean = _tree(tmp_path / "clean", {})
    assert layering_violations(clean) == []
    planted = _tree(tmp_path / "planted", {path: source})
    violations = layering_violations(planted)
    assert len(violations) == 1 and rule in violations[0], violations


def test_the_gateway_and_the_launcher_may_import_what_they_stand_on(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"services/gateway/app.py": "from services.frontend import client\n",
                            "services/batch/runner.py": "from services.frontend.client import c\n",
                            "llm_mesh/launcher.py": "from services.scheduler.settings import s\n"
                                                    "from services.common import wire\n"})
    assert layering_violations(root) == []


def test_core_may_import_itself_and_block_hashes(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"services/scheduler/core/pool.py":
                            "from services.common.block_hash import h\n"
                            "from services.scheduler.core import pool\n"})
    assert layering_violations(root) == []


def test_a_planted_cycle_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "services/scheduler/core/pool.py": "from services.scheduler.service import x\n",
        "services/scheduler/service.py": "from services.scheduler.core.pool import y\n"})
    assert import_cycles(root) == [
        "services.scheduler.core.pool -> services.scheduler.service -> "
        "services.scheduler.core.pool"]


def test_a_planted_cycle_inside_one_package_is_caught(tmp_path: Path) -> None:
    # The files of one folder importing each other, in a type-checking block too.
    root = _tree(tmp_path, {
        "llm_mesh/cli.py": "from llm_mesh.launcher import main\n",
        "llm_mesh/launcher.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from llm_mesh.cli import SERVICES\n"})
    assert import_cycles(root) == ["llm_mesh.cli -> llm_mesh.launcher -> llm_mesh.cli"]
