"""Shared by the C++ CPU kernel tests: the loaded kernels (or a skip with the reason)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

from kernels import cpu_ops
from services.worker.runner.cpu_runtime import cpu_kernels_dir, load_cpu_kernels


def require_cpu_ops() -> ModuleType:
    ops = load_cpu_kernels()
    if ops is None:
        pytest.skip("C++ CPU kernels unavailable: "
                    f"{cpu_ops.unavailable_reason(cpu_kernels_dir())}")
    return ops


@contextmanager
def num_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
