"""The tensor-parallel process group: its collectives, and which CPU cores each rank runs on.

On CPU the all-reduces and all-gathers of tensors that fit go through shared memory
(shm_collectives.py), the rest through the torch.distributed group (gloo; NCCL on GPUs)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.worker.parallel.shm_collectives import SharedMemoryCollectives


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    shm: SharedMemoryCollectives | None = None

    @classmethod
    def join(cls, rank: int, world_size: int, init_method: str, device: torch.device,
             timeout: timedelta,
             shm: SharedMemoryCollectives | None = None) -> TensorParallelGroup:
        """Joins the group (blocks until every rank has, or `timeout`): gloo on CPU, NCCL on
        CUDA. Once it returns, every rank has mapped `shm`."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        # NOTE: NCCL binds each rank to `device` at once (else it guesses the GPU by rank).
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        dist.barrier()
        return cls(rank, world_size, device, shm)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's, in place."""
        dist.broadcast(tensor, src=0)
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place (every rank gets the same bits)."""
        if self.shm is not None and self.shm.fits(tensor.numel() * tensor.element_size()):
            return self.shm.all_reduce(tensor)
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenates every rank's [rows, sizes[rank]] tensor along the last dim. Shares
        that differ are padded to the largest for the collective, then cut back."""
        padded = torch.nn.functional.pad(tensor, (0, max(sizes) - tensor.shape[-1]))
        if self.shm is not None and self.shm.fits(padded.numel() * padded.element_size()):
            gathered = self.shm.all_gather(padded)
        else:
            gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(gathered, padded.contiguous())
        return torch.cat([g[..., :n] for g, n in zip(gathered, sizes, strict=True)], dim=-1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_cores(rank: int, world_size: int) -> set[int] | None:
    """This rank's share of the cores the process may run on (so the ranks' threads never
    compete for one core); None where there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world_size:
        return None
    per_rank = len(cores) // world_size
    return set(cores[rank * per_rank:(rank + 1) * per_rank])
