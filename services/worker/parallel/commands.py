"""Rank 0's calls to its followers: one pipe per follower, each call pickled once.

NOTE: not a torch.distributed broadcast: a follower waits for the next call for as long as
the engine idles, which a collective's timeout would end, and a gloo broadcast cost ~1 ms.
A follower whose rank 0 is gone reads end-of-file and stops."""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch


class CommandSender:
    def __init__(self, connections: list[Connection]):
        self._connections = connections

    def send(self, command: tuple[Any, ...]) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for connection in self._connections:
            connection.send_bytes(data)

    def close(self) -> None:
        for connection in self._connections:
            connection.close()


def receive(connection: Connection, device: torch.device) -> tuple[Any, ...]:
    """The next call (EOFError once rank 0 is gone), tensors on this rank's device."""
    return _to_device(pickle.loads(connection.recv_bytes()), device)


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors anywhere in tuples, lists, dicts and dataclass fields moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            object.__setattr__(obj, name, _to_device(getattr(obj, name), device))
    return obj
