"""Faults a CPU KV cache's pages in from a background thread, in the order blocks are used.

The cache is mapped lazily (kv_cache._lazily_zeroed): the kernel zeroes a page when it is
first written, inside the step that writes it. On transparent huge pages that is 2 MiB at a
time, in every layer's K and V region at once when fresh blocks cross a page boundary.
NOTE: on a 2-core AMX Xeon VM a huge page took 6 ms to fault (MADV_POPULATE_WRITE over 2 GiB:
6.1 s of kernel time; 4 KiB pages: 1.0 s), and one decode step that first wrote into new
pages of the 60 regions of SmolLM2's cache stalled for ~500 ms. The scheduler hands out
never-used blocks in ascending id order (block_pool.py), so a low-priority thread that
populates the regions block range by block range stays ahead of it, mostly while the worker
idles after start-up. MADV_POPULATE_WRITE (Linux 5.14+) maps pages writable without
changing what they hold, so it is safe beside steps writing the same pages.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable

import structlog
import torch

log = structlog.get_logger(__name__)

MADV_DONTNEED = 4          # linux/mman.h
MADV_POPULATE_WRITE = 23
_CHUNK_BYTES = 2 << 20     # per region per call: one huge page
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def prefault(storage: torch.Tensor, num_regions: int) -> bool:
    """Populates the pages of `storage` (contiguous, num_regions regions of equal size whose
    first dim is the block id), block range by block range across the regions; the values
    are untouched. False where the kernel cannot (not Linux, or older than 5.14: EINVAL);
    OSError where it refused for another reason (ENOMEM: memory ran out)."""
    madvise = _madvise()
    if madvise is None or not storage.is_contiguous():
        return False
    region_bytes = storage.numel() * storage.element_size() // num_regions
    base = storage.data_ptr()
    # NOTE: a call costs ~6 ms on huge pages and ctypes drops the GIL for it: the worker's
    # step thread is never held up by more than the kernel's own page work.
    for start in range(0, region_bytes, _CHUNK_BYTES):
        end = min(start + _CHUNK_BYTES, region_bytes)
        for region in range(num_regions):
            first = base + region * region_bytes + start
            aligned = first - first % _PAGE
            if madvise(aligned, base + region * region_bytes + end - aligned,
                       MADV_POPULATE_WRITE) != 0:
                error = ctypes.get_errno()
                if error == errno.EINVAL:
                    return False
                raise OSError(error, os.strerror(error))
    return True


def release_pages(storage: torch.UntypedStorage) -> None:
    """Sleep mode: hands the pages of a CPU storage back to the kernel (MADV_DONTNEED); the
    tensors stay valid and read zeros when next touched, as the lazily mapped cache does at
    start-up. Only the whole pages inside it go: partial ones may be a neighbour's. Where
    the kernel cannot, the pages stay (the memory is not given back; nothing breaks)."""
    madvise = _madvise()
    first = -(-storage.data_ptr() // _PAGE) * _PAGE
    end = (storage.data_ptr() + storage.nbytes()) // _PAGE * _PAGE
    if madvise is not None and end > first:
        madvise(first, end - first, MADV_DONTNEED)


def lowest_priority(thread_id: int) -> None:
    """Linux: SCHED_IDLE for one thread, else nice 19. NOTE: not nice 19 alone: that thread
    (weight 15 to SCHED_IDLE's 3) took more of the step threads' cores for the prefault's
    10-50 s after start-up, and it may preempt a service that `llm-mesh up` runs under
    SCHED_IDLE when it wakes (docs/benchmarks.md 10l, 10m)."""
    try:
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:   # a thread's own nice value
        os.setpriority(os.PRIO_PROCESS, thread_id, 19)
    except (AttributeError, OSError):
        pass


def prefault_in_background(storage: torch.Tensor, num_regions: int) -> threading.Thread:
    """prefault() in a daemon thread at the lowest CPU priority; logs when done."""

    def run() -> None:
        lowest_priority(threading.get_native_id())
        started = time.monotonic()
        gib = storage.numel() * storage.element_size() / 2**30
        try:
            done = prefault(storage, num_regions)
        except OSError as error:
            log.warning("KV cache pages fault in as first written: populating them ahead "
                        "failed", error=str(error))
            return
        if done:
            log.info("KV cache pages faulted in", gib=round(gib, 2),
                     seconds=round(time.monotonic() - started, 1))
        else:
            log.info("KV cache pages fault in as first written (this kernel has no "
                     "MADV_POPULATE_WRITE)")

    thread = threading.Thread(target=run, name="kv-prefault", daemon=True)
    thread.start()
    return thread
