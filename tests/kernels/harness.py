"""Runs kernel cases on the test device: compiled on CUDA, in an interpreter subprocess on CPU.

NOTE: why a subprocess on CPU, rather than TRITON_INTERPRET=1 at the top of the test module:
- an unmasked out-of-bounds load SIGSEGVs the interpreter, which would kill the whole pytest
  run; in a child process it fails only the case that was running;
- triton decides interpreter-or-compiled when a kernel is decorated (module import), so any
  earlier import of kernels in the pytest process (another team's tests) would leave them
  compiled for a GPU that is not there; the child sets the variable before anything imports.
One child per test module (~3 s to import torch + triton) keeps the suite fast; each case
reports a start and a result line, so a crash is pinned on the case that caused it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.kernel_cases import CASES, RESULT_MARK

REPO_ROOT = Path(__file__).resolve().parents[2]
# KERNEL_TEST_DEVICE=cuda forces the GPU; otherwise CUDA is used when present.
DEVICE = os.environ.get("KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
SUBPROCESS_TIMEOUT_S = 300


def json_cases(module: str) -> dict[str, dict]:
    """Runs `python -m <module>`, which prints one JSON line per case ({"case": name, ...})
    of its kernels run on KERNEL_TEST_DEVICE, and returns the lines by case name.

    On CUDA the kernels compile for the GPU (TRITON_INTERPRET unset, whatever the parent's
    environment says); on CPU they run under the interpreter (TRITON_INTERPRET=1).
    """
    env = {**os.environ, "KERNEL_TEST_DEVICE": DEVICE}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=2 * SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


def run_in_interpreter(names: list[str]) -> dict[str, str | None]:
    """{case: None if it passed, else the error text}, from interpreter subprocesses.

    If the interpreter dies, the case it was running fails and the rest run in a new process.
    """
    results: dict[str, str | None] = {}
    pending = list(names)
    while pending:
        ran = _run_subprocess(pending)
        results.update(ran)
        pending = [name for name in pending if name not in ran]
    return results


def _run_subprocess(names: list[str]) -> dict[str, str | None]:
    """Results of the cases that finished, plus the one running when the process died."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNEL_TEST_DEVICE": "cpu"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.kernels.kernel_cases", *names],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr, returncode = f"timed out after {SUBPROCESS_TIMEOUT_S} s", None
    results: dict[str, str | None] = {}
    running = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            record = json.loads(line[len(RESULT_MARK):])
            running = record["case"] if record["event"] == "start" else None
            if record["event"] == "done":
                results[record["case"]] = record["error"]
    if len(results) < len(names):
        # Blame the case that was running, or the first one if none had started.
        crashed = running or next(name for name in names if name not in results)
        results[crashed] = (
            f"interpreter subprocess died during this case (exit code {returncode});"
            f" stderr tail:\n{stderr[-3000:]}"
        )
    return results


def module_results(request: pytest.FixtureRequest, names: list[str]) -> dict[str, str | None]:
    """For a module-scoped fixture: runs, in one subprocess, the module's selected cases."""
    if DEVICE != "cpu":
        return {}
    selected = {
        item.callspec.params.get("name")
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    return run_in_interpreter(
        [n for n in names if n in selected and not CASES[n].cuda_only]
    )


def check_case(name: str, results: dict[str, str | None]) -> None:
    """Runs (CUDA) or looks up (CPU) one case and fails the test with its error."""
    case = CASES[name]
    if DEVICE != "cpu":
        case.run(DEVICE)
        return
    if case.cuda_only:
        pytest.skip("shape too large for the interpreter; runs on CUDA")
    error = results[name]
    if error is not None:
        pytest.fail(error, pytrace=False)
