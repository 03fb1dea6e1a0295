"""Where a benchmark's CPU went: the seconds each process of a mesh (and the bench client)
spent on the cores while a bench ran, so a comparison shows what competes with the worker
for them (on a 2-core machine, every service's per-token work is time the model's threads
do not get)."""

from __future__ import annotations

import re
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

_SERVICE_MODULE = re.compile(r"^services\.(\w+)$")


@dataclass
class CpuUse:
    wall_s: float = 0.0
    by_process: dict[str, float] = field(default_factory=dict)   # label -> CPU seconds
    busiest_thread: dict[str, float] = field(default_factory=dict)

    def report(self) -> str:
        parts = []
        for label, seconds in sorted(self.by_process.items(), key=lambda kv: -kv[1]):
            thread = self.busiest_thread.get(label)
            busiest = f" (busiest thread {thread:.1f})" if thread else ""
            parts.append(f"{label} {seconds:.1f}{busiest}")
        total = sum(self.by_process.values())
        return (f"CPU seconds over {self.wall_s:.1f} s of wall time "
                f"({psutil.cpu_count()} cores, {total:.1f} s used): " + ", ".join(parts))


def _label(process: psutil.Process) -> str:
    try:
        argv = process.cmdline()
    except psutil.Error:
        return "?"
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            match = _SERVICE_MODULE.match(argv[i + 1])
            return match.group(1) if match else argv[i + 1]
    return argv[0].rsplit("/", 1)[-1] if argv else "?"


def _snapshot(root_pid: int) -> dict[int, tuple[str, float, dict[int, float]]]:
    """{pid: (label, CPU seconds, {thread id: CPU seconds})} of the tree under root_pid."""
    root = psutil.Process(root_pid)
    found = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            threads = {t.id: t.user_time + t.system_time for t in process.threads()}
        except psutil.Error:
            continue
        label = "launcher" if process.pid == root_pid else _label(process)
        found[process.pid] = (label, times.user + times.system, threads)
    return found


@contextmanager
def cpu_use(root_pid: int) -> Iterator[CpuUse]:
    """Fills the yielded CpuUse when the block ends: each process's CPU seconds during it
    (processes of one kind summed), and the bench client's as this process's children's."""
    use = CpuUse()
    before = _snapshot(root_pid)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    yield use
    use.wall_s = time.monotonic() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    by_process: dict[str, float] = defaultdict(float)
    busiest: dict[str, float] = defaultdict(float)
    for pid, (label, seconds, threads) in _snapshot(root_pid).items():
        _, seconds_before, threads_before = before.get(pid, (label, 0.0, {}))
        by_process[label] += seconds - seconds_before
        deltas = [t - threads_before.get(tid, 0.0) for tid, t in threads.items()]
        busiest[label] = max(busiest[label], max(deltas, default=0.0))
    by_process["bench client"] = (children.ru_utime + children.ru_stime
                                  - children_before.ru_utime - children_before.ru_stime)
    use.by_process = dict(by_process)
    use.busiest_thread = dict(busiest)
