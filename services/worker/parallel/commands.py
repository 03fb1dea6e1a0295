"""Rank 0's calls to its followers: one pipe per follower, each call pickled once.

Host tensors travel inside the pickle. Accelerator tensors never do: pickling a CUDA tensor
saves its device, so every follower would unpickle it onto cuda:0 first (a CUDA context and
an allocation on rank 0's GPU, after rank 0 sized its KV cache from that GPU's free memory).
The pickle carries their shapes and dtypes instead, and the bytes follow in one broadcast over
the group (NCCL: device to device, no host copy), straight into each rank's own device.

NOTE: the call itself stays on the pipe, not a torch.distributed broadcast: a follower waits
for the next call for as long as the engine idles, which a collective's timeout would end,
and a gloo broadcast cost ~1 ms. A follower whose rank 0 is gone reads end-of-file and stops.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch

from services.worker.parallel.group import TensorParallelGroup

# Tensors are cut from the broadcast buffer at offsets aligned for any dtype's view.
_ALIGN = 16

Spec = tuple[tuple[int, ...], torch.dtype]   # a broadcast tensor's shape and dtype


class CommandSender:
    """by_broadcast: tensors on this device type (the accelerator's; None: none) travel by
    broadcast over the group rather than in the pickle."""

    def __init__(self, connections: list[Connection], group: TensorParallelGroup,
                 by_broadcast: str | None):
        self._connections = connections
        self._group = group
        self._by_broadcast = by_broadcast

    def send(self, command: tuple[Any, ...]) -> None:
        """One message per follower, the broadcast tensors' specs pickled ahead of the call
        (a follower allocates their buffer before it rebuilds the call around it)."""
        pickled = io.BytesIO()
        pickler = _Pickler(pickled, self._by_broadcast)
        pickler.dump(command)
        tensors = pickler.tensors
        message = io.BytesIO()
        pickle.dump([(tuple(t.shape), t.dtype) for t in tensors], message,
                    protocol=pickle.HIGHEST_PROTOCOL)
        message.write(pickled.getbuffer())
        for connection in self._connections:
            connection.send_bytes(message.getbuffer())
        if tensors:
            data = torch.empty(_total_bytes(tensors), dtype=torch.uint8,
                               device=tensors[0].device)
            for view, tensor in zip(_views(data, tensors), tensors, strict=True):
                view.copy_(tensor)
            self._group.broadcast(data)

    def close(self) -> None:
        for connection in self._connections:
            connection.close()


def decode(message: bytes, group: TensorParallelGroup) -> tuple[Any, ...]:
    """A call from its pipe message (Connection.recv_bytes); its broadcast tensors, received
    here, are views of one buffer on this rank's device."""
    stream = io.BytesIO(message)
    specs: list[Spec] = pickle.load(stream)
    views: list[torch.Tensor] = []
    if specs:
        data = torch.empty(_total_bytes(specs), dtype=torch.uint8, device=group.device)
        group.broadcast(data)
        views = _views(data, specs)
    return _Unpickler(stream, views).load()


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, by_broadcast: str | None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._by_broadcast = by_broadcast
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> int | None:
        """A broadcast tensor's index in place of its bytes."""
        if isinstance(obj, torch.Tensor) and obj.device.type == self._by_broadcast:
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, views: list[torch.Tensor]):
        super().__init__(file)
        self._views = views

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._views[pid]


def _spec(item: torch.Tensor | Spec) -> Spec:
    return (tuple(item.shape), item.dtype) if isinstance(item, torch.Tensor) else item


def _nbytes(spec: Spec) -> int:
    return torch.Size(spec[0]).numel() * spec[1].itemsize


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _total_bytes(items: list[torch.Tensor] | list[Spec]) -> int:
    return sum(_padded(_nbytes(_spec(item))) for item in items)


def _views(data: torch.Tensor, items: list[torch.Tensor] | list[Spec]) -> list[torch.Tensor]:
    """Views of the uint8 buffer `data` shaped as each tensor or spec, in order."""
    views, offset = [], 0
    for item in items:
        shape, dtype = spec = _spec(item)
        nbytes = _nbytes(spec)
        views.append(data[offset:offset + nbytes].view(dtype).view(shape))
        offset += _padded(nbytes)
    return views
