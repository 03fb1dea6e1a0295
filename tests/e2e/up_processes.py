"""The processes of an `llm-mesh up` under test, found through /proc: its children, the
service (or embedded server) each runs, and the launcher's own JSON log lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def argv_of(pid: int) -> list[bytes]:
    """A process's command line; empty once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:   # it exited meanwhile
        return []


def service_of(pid: int) -> str | None:
    """The mesh service a process runs (`python -m services.<name>`), None for others."""
    argv = argv_of(pid)
    module = argv[argv.index(b"-m") + 1].decode() if b"-m" in argv else ""
    return module.split(".")[1] if module.startswith("services.") else None


def child_running(launcher_pid: int, name: str) -> int | None:
    """The launcher's child that runs `name`: a service ("tokenizer") or an embedded
    server's binary ("nats-server", "valkey-server"); None while there is none."""
    for pid in children_of(launcher_pid):
        argv = argv_of(pid)
        # NOTE: valkey-server rewrites its command line to "<binary> <host>:<port>".
        binary = Path(argv[0].split(b" ")[0].decode()).name if argv else None
        if name in (service_of(pid), binary):
            return pid
    return None


def launcher_events(log_path: Path, event: str) -> list[dict[str, Any]]:
    """The launcher's JSON log lines saying `event` (the services log to the same file)."""
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue   # a console line, or one another process's output cut into
        if isinstance(record, dict) and record.get("instance") == "launcher" \
                and record.get("event") == event:
            found.append(record)
    return found
