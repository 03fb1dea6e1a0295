"""Rank 0's calls to a tensor-parallel follower (services/worker/parallel/commands.py), between
real processes over gloo: the follower rebuilds each call with equal tensors (views, bf16,
bool, empty, nested in a dataclass) whether they travel in the pickle or, as device tensors
do on GPUs, by a broadcast over the group; broadcast tensors leave the pipe message small."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from services.common.ports import free_port
from services.worker.parallel.commands import CommandSender, decode
from services.worker.parallel.group import TensorParallelGroup

BIG = 1 << 14   # float32 elements: 64 KiB, far more than a broadcast call's message


@dataclass
class Metadata:   # an attention-metadata-like payload: tensors beside host values
    block_table: torch.Tensor
    seq_lens_cpu: np.ndarray
    num_decodes: int
    scales: torch.Tensor
    mask: torch.Tensor


def _commands() -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(40, dtype=torch.int64).view(8, 5)
    table = torch.randint(0, 99, (3, 6), generator=gen, dtype=torch.int32)
    return [
        ("forward", ids[:, 1::2], torch.empty(0, 4), Metadata(
            table[1:], np.array([3, 9]), 2, torch.randn(5, 3, generator=gen).bfloat16(),
            torch.rand(4, generator=gen) > 0.5)),
        ("logits", torch.randn(BIG, generator=gen)),
        ("bind_kv_caches", 17),
    ]


def _assert_same(got: object, want: object) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got, want)
    elif isinstance(want, Metadata):
        for name in want.__dataclass_fields__:
            _assert_same(getattr(got, name), getattr(want, name))
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want)
    else:
        assert got == want


def _rank(rank: int, init_method: str, pipe: Connection, by_broadcast: str | None,
          results: multiprocessing.Queue) -> None:
    group = TensorParallelGroup.join(rank, 2, init_method, torch.device("cpu"),
                                     timedelta(seconds=60))
    try:
        if rank == 0:
            sender = CommandSender([pipe], group, by_broadcast)
            for command in _commands():
                sender.send(command)
            sender.close()
            return
        received = []
        while True:
            try:
                message = pipe.recv_bytes()
            except EOFError:
                break
            received.append((len(message), decode(message, group)))
        for (size, got), want in zip(received, _commands(), strict=True):
            assert got[0] == want[0]
            for g, w in zip(got[1:], want[1:], strict=True):
                _assert_same(g, w)
            results.put((got[0], size))
        results.put("done")
    except BaseException as e:   # the parent fails the test with it
        results.put(repr(e))
        raise
    finally:
        group.close()


@pytest.mark.parametrize("by_broadcast", [None, "cpu"])
def test_a_follower_rebuilds_every_call(by_broadcast: str | None) -> None:
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=_rank, args=(rank, init_method, pipe, by_broadcast,
                                                 results))
             for rank, pipe in ((0, writer), (1, reader))]
    for process in ranks:
        process.start()
    reader.close()
    writer.close()
    sizes = {}
    while (item := results.get(timeout=120)) != "done":
        assert isinstance(item, tuple), item
        sizes[item[0]] = item[1]
    for process in ranks:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert set(sizes) == {"forward", "logits", "bind_kv_caches"}
    if by_broadcast:   # the 64 KiB tensor came by broadcast, not in the message
        assert sizes["logits"] < 1024, sizes
    else:
        assert sizes["logits"] > 4 * BIG, sizes
