"""Shared by the C++ CPU kernel tests: the loaded kernels (or a skip with the reason)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

from kernels import cpu_ops


def require_cpu_ops() -> ModuleType:
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip(f"C++ CPU kernels unavailable: {cpu_ops.unavailable_reason()}")
    return ops


@contextmanager
def num_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
