"""The priority `llm-mesh up` gives a service: set in the child before it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest

from llm_mesh.launcher import Priority, _prepare_child

REPORT = "import os; print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))"


def child_priority(priority: Priority) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", REPORT], check=True, capture_output=True,
                         text=True, preexec_fn=partial(_prepare_child, priority)).stdout
    policy, nice = out.split()
    return int(policy), int(nice)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_sched_idle_is_set_in_the_child() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert child_priority(Priority(sched_idle=True, nice=10)) == (os.SCHED_IDLE, own)


def test_without_sched_idle_the_child_is_niced() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert child_priority(Priority(nice=10)) == (os.SCHED_OTHER, min(own + 10, 19))
    assert child_priority(Priority()) == (os.SCHED_OTHER, own)


def test_the_log_names_the_policy_in_force() -> None:
    assert Priority(sched_idle=True, nice=10).log_fields == {"sched_idle": True}
    assert Priority(nice=10).log_fields == {"nice": 10}
