"""kv_prefault: the KV cache's pages become resident without their contents changing."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from services.worker.kv.kv_cache import KVCacheSpec, _lazily_zeroed, allocate_kv_caches
from services.worker.kv.kv_prefault import lowest_priority, prefault

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of the tensor's memory, as mincore(2) reports them."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = tensor.data_ptr() - tensor.data_ptr() % PAGE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec), pages


def test_prefault_makes_pages_resident_and_keeps_what_they_hold() -> None:
    # Two regions of 3 MiB and a bit: chunks of a huge page, and a tail.
    storage = _lazily_zeroed((2, 3 * 2**20 + 4096), torch.uint8)
    storage[0, 5] = 7                   # written before: must survive
    storage[1, -1] = 9
    before, total = resident_pages(storage)
    assert before < total
    if not prefault(storage, num_regions=2):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert resident_pages(storage) == (total, total)
    expected = torch.zeros_like(storage)
    expected[0, 5], expected[1, -1] = 7, 9
    assert torch.equal(storage, expected)


def test_a_cpu_kv_cache_is_faulted_in_in_the_background() -> None:
    if not prefault(_lazily_zeroed((4096,), torch.uint8), num_regions=1):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)
    caches = allocate_kv_caches(spec, num_blocks=400, device=torch.device("cpu"))
    regions = [t for cache in caches for t in (cache.key, cache.value)]
    for thread in [t for t in threading.enumerate() if t.name == "kv-prefault"]:
        thread.join(timeout=30)
        assert not thread.is_alive(), "the KV cache was not faulted in within 30 s"
    for region in regions:
        resident, total = resident_pages(region)
        assert resident == total
    assert all(torch.count_nonzero(t) == 0 for t in regions)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_prefault_thread_yields_to_every_other_thread() -> None:
    # SCHED_IDLE, as `llm-mesh up` runs the other services: nice 19 would still take cores
    # from the step threads and preempt those services when it wakes.
    seen: list[int] = []

    def run() -> None:
        lowest_priority(threading.get_native_id())
        seen.append(os.sched_getscheduler(threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER   # the rest of the process keeps its own
