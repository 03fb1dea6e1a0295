"""The mesh's liveness clock in one place: how often every service says it is alive, how long
a silence means it is gone, and how often the watchers look. The defaults of the timeout
settings come from here, and the relations between these numbers are checked here, once:
a timeout shorter than a few heartbeats would declare live instances gone after one late
beat, and a watcher slower than the timeout it enforces would notice deaths late.

Timings that bound one call or one retry loop (a JetStream read, a backoff) stay beside the
code they bound: nothing else depends on them.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL_S = 1.0
"""Every service publishes its heartbeat this often (services/common/service.py)."""

MIN_HEARTBEATS_PER_TIMEOUT = 2.0
"""A liveness timeout spans more than this many heartbeats: one late beat is not a death."""

INSTANCE_TIMEOUT_S = 3.5
"""Default --instance-timeout-s: a gateway forgets a tokenizer or scheduler (and moves its
requests), a tokenizer a gateway (and drops its requests), silent this long."""

WORKER_HEARTBEAT_TIMEOUT_S = 5.0
"""Default --worker-heartbeat-timeout-s: a scheduler counts its worker lost."""

INSTANCE_SWEEP_INTERVAL_S = 0.5
"""How often a gateway sweeps its view for instances past the instance timeout."""

STEP_WATCH_INTERVAL_S = 0.5
"""How often a scheduler checks its steps in flight against its worker's heartbeat and
incarnation (services/scheduler/worker_link.py)."""


def check_liveness_timeout(flag: str, timeout_s: float) -> None:
    """Raises ValueError (a settings error: the service does not start) for a liveness
    timeout that one late heartbeat could exceed."""
    least = MIN_HEARTBEATS_PER_TIMEOUT * HEARTBEAT_INTERVAL_S
    if timeout_s <= least:
        raise ValueError(f"{flag} must be above {least:g} s: heartbeats come every "
                         f"{HEARTBEAT_INTERVAL_S:g} s, and one late beat is not a death")


for _flag, _default in (("--instance-timeout-s", INSTANCE_TIMEOUT_S),
                        ("--worker-heartbeat-timeout-s", WORKER_HEARTBEAT_TIMEOUT_S)):
    check_liveness_timeout(_flag, _default)
assert INSTANCE_SWEEP_INTERVAL_S < INSTANCE_TIMEOUT_S - HEARTBEAT_INTERVAL_S, \
    "a sweep must come between the last beat a timeout allows and the timeout"
assert STEP_WATCH_INTERVAL_S < WORKER_HEARTBEAT_TIMEOUT_S - HEARTBEAT_INTERVAL_S, \
    "steps in flight must be checked more often than a worker can be declared lost"
