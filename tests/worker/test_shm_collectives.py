"""The shared-memory collectives of tensor parallelism between real processes: many
back-to-back all-reduces and all-gathers of varying shapes and dtypes (the alternating
slots must never let a fast rank overwrite what a slow one still reads) give every rank the
same, exact results."""

from __future__ import annotations

import multiprocessing
import queue
from pathlib import Path

import torch

from services.worker.parallel.shm_collectives import SharedMemoryCollectives, new_segment_path

WORLD = 2
ROUNDS = 60
SLOT_BYTES = 2**16


def _inputs(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    rows = 1 + step % 7
    dtype = torch.bfloat16 if step % 3 == 0 else torch.float32
    return torch.randn(rows, 96, generator=generator).to(dtype)


def _rank(path: Path, rank: int, results: multiprocessing.Queue) -> None:
    shm = SharedMemoryCollectives(path, rank, WORLD, create=False, slot_bytes=SLOT_BYTES)
    out = []
    for step in range(ROUNDS):
        if step % 2:
            out.append(torch.cat(shm.all_gather(_inputs(rank, step)), dim=-1))
        else:
            out.append(shm.all_reduce(_inputs(rank, step)))
    # Plain lists: a tensor put on a queue would share its memory with a process that ends.
    results.put((rank, [(t.dtype, t.float().tolist()) for t in out]))


def test_every_rank_gets_the_exact_sum_and_every_share() -> None:
    path = new_segment_path()
    SharedMemoryCollectives(path, 0, WORLD, create=True, slot_bytes=SLOT_BYTES)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(path, r, results)) for r in range(WORLD)]
    try:
        for process in ranks:
            process.start()
        got: dict[int, list[tuple[torch.dtype, list]]] = {}
        while len(got) < WORLD:
            try:
                rank, out = results.get(timeout=1.0)
                got[rank] = out
            except queue.Empty:
                assert all(p.is_alive() for p in ranks), "a rank died"
    finally:
        path.unlink()
        for process in ranks:
            process.join(timeout=30)
    for step in range(ROUNDS):
        parts = [_inputs(r, step) for r in range(WORLD)]
        want = torch.cat(parts, dim=-1) if step % 2 else parts[0] + parts[1]
        for rank in range(WORLD):
            dtype, values = got[rank][step]
            assert dtype == want.dtype and torch.equal(torch.tensor(values), want.float()), \
                (rank, step)


def test_a_tensor_bigger_than_a_slot_does_not_fit() -> None:
    path = new_segment_path()
    try:
        shm = SharedMemoryCollectives(path, 0, WORLD, create=True, slot_bytes=1024)
        assert shm.fits(1024) and not shm.fits(1025)
    finally:
        path.unlink()
