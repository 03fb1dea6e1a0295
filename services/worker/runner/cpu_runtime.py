"""Process-wide CPU settings for a worker that runs the model on the host, and where its C++
kernels are built."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from types import ModuleType

import structlog
import torch

from kernels import cpu_ops
from services.common.model_files import cache_root

log = structlog.get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 2**30


def configure_cpu_runtime(num_threads: int | None) -> int:
    """Sets torch's thread count (default: every core we may run on) and tunes glibc malloc.

    NOTE: by default glibc serves allocations over its mmap threshold with fresh mmap()s and
    returns freed heap tops to the OS, so every activation of a few MB page-faults anew on each
    step: measured 3-5x slower elementwise ops at 512 tokens. Raising both thresholds keeps freed
    activations in the heap for reuse (what jemalloc/tcmalloc preloads do for vLLM on CPU).
    """
    threads = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name)
        tuned = (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
                 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1)
    except (OSError, AttributeError):
        tuned = False
    if not tuned:
        log.warning("could not tune malloc (not glibc?): expect slower large batches")
    return threads


def cpu_kernels_dir() -> Path:
    """Where the C++ CPU kernels are built: in the mesh cache, shared by every worker."""
    return cache_root() / "torch_extensions"


def load_cpu_kernels() -> ModuleType | None:
    """The C++ CPU kernels (kernels/cpu_ops.py), or None: callers keep their torch path."""
    return cpu_ops.load(cpu_kernels_dir())
