"""The waiting queue, one class per policy (vLLM's request_queue.py).

Each policy also defines `sort_key`: the order in which requests deserve to run. The
scheduler preempts the running request with the largest key, so the policy that decides
who runs first also decides who is preempted last.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from services.scheduler.core.request import Request


class RequestQueue(ABC):
    @staticmethod
    @abstractmethod
    def sort_key(request: Request) -> tuple:
        """Smaller runs first and is preempted last."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """A preempted request goes back where it runs as soon as blocks allow."""

    @abstractmethod
    def head(self, n: int) -> list[Request]:
        """The n requests next in line, the first first."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served; preempted requests go to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    @staticmethod
    def sort_key(request: Request) -> tuple:
        return (request.arrival_time, request.arrival_order)

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def head(self, n: int) -> list[Request]:
        return list(itertools.islice(self._queue, n))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(map(id, requests))
        self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest `priority` value first, then earliest arrival. A preempted request keeps its
    key, so it goes back ahead of everything that arrived after it."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    @staticmethod
    def sort_key(request: Request) -> tuple:
        return (request.priority, request.arrival_time, request.arrival_order)

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                    request.arrival_order, request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def head(self, n: int) -> list[Request]:
        return [entry[-1] for entry in heapq.nsmallest(n, self._heap)]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(map(id, requests))
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In no particular order."""
        return (entry[-1] for entry in self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
