"""The wheel users install: it holds every file the code opens at run time, and installed
non-editable into a fresh venv (no checkout on its path, started outside it) `llm-mesh up`
serves a chat completion, with the C++ CPU kernels where this machine can build them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kernels import cpu_ops
from services.common.ports import free_port
from services.worker.runner.cpu_runtime import cpu_kernels_dir
from tests.mesh import ENGINE_ARGS, REPO_ROOT, http_get, http_post
from tests.packaging.wheel import (
    build_wheel,
    copy_source,
    install_in_fresh_venv,
    package_files,
    wheel_files,
)

STARTUP_TIMEOUT_S = 300
WHERE_ARE_THE_PACKAGES = ("import kernels, llm_mesh, services; "
                          "print(kernels.__file__, llm_mesh.__file__, services.__file__)")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the copied source tree, the wheel built from it)."""
    source = copy_source(tmp_path_factory.mktemp("wheel-source"))
    return source, build_wheel(source, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_file_of_the_packages(built: tuple[Path, Path]) -> None:
    source, wheel = built
    missing = sorted(package_files(source) - wheel_files(wheel))
    assert not missing, (f"the wheel lacks {missing}: declare them under "
                         f"[tool.setuptools.package-data] in pyproject.toml")
    assert {"kernels/cpu/bindings.cpp", "kernels/cpu/cpu_common.h",
            "services/tokenizer/templates/tool_use.jinja"} <= wheel_files(wheel)


def _model_load_line(log: Path) -> dict:
    for line in log.read_text(errors="replace").splitlines():
        if '"model weights loaded"' in line:
            return json.loads(line)
    raise AssertionError(f"no 'model weights loaded' line in {log}")


@pytest.mark.slow
def test_installed_wheel_serves_a_chat_completion(built: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    python = install_in_fresh_venv(built[1], tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run(
        [str(python), "-c", WHERE_ARE_THE_PACKAGES], cwd=tmp_path, env=env,
        capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(f).is_relative_to(tmp_path / "venv") for f in where), where
    assert not any(Path(f).is_relative_to(REPO_ROOT) for f in where), where

    port = free_port()
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [str(tmp_path / "venv" / "bin" / "llm-mesh"), "up", "--port", str(port),
             "--log-format", "json", *ENGINE_ARGS], cwd=tmp_path, stdout=out,
            stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while http_get(f"http://127.0.0.1:{port}/health")[0] != 200:
            assert launcher.poll() is None, f"llm-mesh up exited:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-6000:]}"
            time.sleep(0.2)
        status, body = http_post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["message"]["content"]
        # The kernels built from the wheel's own sources (those of this checkout share a
        # build folder with them only where every source file is there, byte for byte).
        expected = "torch" if cpu_ops.unavailable_reason(cpu_kernels_dir()) else "cpu"
        assert _model_load_line(log)["attention_backend"] == expected
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=60)
    assert code == 0, log.read_text()[-6000:]
