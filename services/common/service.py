"""Service lifecycle: connect, start, serve, drain, clean up.

Every service subclasses `Service` and fills in `setup` (subscribe, load), `drain` (finish
in-flight work) and `readiness`. `run_service` runs one under uvloop: SIGTERM or SIGINT
starts a drain bounded by --drain-timeout-s, then the process exits. While it runs, the
service answers /health, /ready, /metrics (on its health port, and /metrics over NATS too)
and publishes a heartbeat every second (services/common/timing.py), which is how the gateway
knows what the mesh holds.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from abc import ABC, abstractmethod
from typing import ClassVar

import uvloop
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, generate_latest

from services.common import wire
from services.common.bus import Bus, BusError
from services.common.health import HealthServer
from services.common.logs import configure_logging
from services.common.settings import CommonSettings, public_view
from services.common.startup import StartupPhases, process_age_s
from services.common.subjects import Subjects
from services.common.tasks import BackgroundTasks
from services.common.timing import HEARTBEAT_INTERVAL_S


class Service(ABC):
    name: ClassVar[str]

    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.instance_id = settings.instance_id or f"{self.name}-{secrets.token_hex(4)}"
        self.log = configure_logging(self.name, self.instance_id, settings.log_level,
                                     settings.log_format)
        self.subjects = Subjects(settings.namespace)
        self.registry = CollectorRegistry()
        self.bus: Bus | None = None
        self.health: HealthServer | None = None
        self.stopping = asyncio.Event()
        self.is_set_up = False
        self.startup = StartupPhases()
        """Start-up phases, said in the `ready` line; setup() may add its own."""
        self.background = BackgroundTasks(self.log)
        """Long-lived tasks of the service: cancelled after drain, before close()."""

    # ---- what subclasses provide

    @abstractmethod
    async def setup(self) -> None:
        """Load what the service needs and subscribe to its subjects."""

    async def drain(self) -> None:
        """Stop taking new work and finish what is in flight (bounded by the caller)."""

    def readiness(self) -> tuple[bool, str]:
        """Whether the service can make forward progress now, and why not."""
        return True, ""

    def fill_heartbeat(self, heartbeat: wire.Heartbeat) -> None:
        """Adds service-specific state to the heartbeat."""

    async def close(self) -> None:
        """Releases what setup acquired (after drain)."""

    # ---- the lifecycle

    def is_ready(self) -> tuple[bool, str]:
        if self.bus is None or not self.bus.is_connected:
            return False, "NATS not connected"
        if self.stopping.is_set():
            return False, "stopping"
        if not self.is_set_up:
            return False, "starting"
        return self.readiness()

    @property
    def connected_bus(self) -> Bus:
        assert self.bus is not None, "bus used before run() connected it"
        return self.bus

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.startup.add("interpreter and imports", process_age_s())
        self.log.info("starting", settings=public_view(self.settings))
        self.health = HealthServer(self.settings.health_host, self.settings.health_port,
                                   self.is_ready, self.registry)
        port = await self.health.start()
        self.log.info("health server listening", url=f"http://{self.settings.health_host}:{port}")
        with self.startup.phase("NATS connect"):
            self.bus = await Bus.for_settings(self.settings, name=self.instance_id)
        await self.bus.client.subscribe(
            self.subjects.service_metrics(self.name, self.instance_id), cb=self._on_metrics)
        self.background.spawn(self._heartbeat_loop(), name="heartbeat")
        try:
            setup = asyncio.create_task(self._timed_setup())
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait({setup, stop}, return_when=asyncio.FIRST_COMPLETED)
            if setup.done():
                setup.result()  # re-raise a failed setup
                self.is_set_up = True
                self.log.info("ready", startup_s=round(process_age_s(), 2),
                              phases=self.startup.as_log())
                await stop
            else:
                setup.cancel()
            self.log.info("draining", timeout_s=self.settings.drain_timeout_s)
            # NOTE: said at once, not at the next beat: gateways stop routing here now.
            await self._publish_heartbeat()
            draining_since = time.perf_counter()
            try:
                await asyncio.wait_for(self.drain(), timeout=self.settings.drain_timeout_s)
                self.log.info("drained", seconds=round(time.perf_counter() - draining_since, 2))
            except asyncio.TimeoutError:
                self.log.warning("drain timed out; stopping with work in flight")
        finally:
            await self.background.close()
            await self.close()
            await self.bus.close()
            await self.health.stop()
            self.log.info("stopped")

    async def _timed_setup(self) -> None:
        """setup(), as one phase unless it named its own."""
        named_before = len(self.startup.seconds)
        started = time.perf_counter()
        await self.setup()
        if len(self.startup.seconds) == named_before:
            self.startup.add("setup", time.perf_counter() - started)

    async def _on_metrics(self, msg: Msg) -> None:
        """/metrics over NATS: what a scrape of the health port returns."""
        await msg.respond(generate_latest(self.registry))

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._publish_heartbeat()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _publish_heartbeat(self) -> None:
        ready, reason = self.is_ready()
        beat = wire.Heartbeat(service=self.name, instance_id=self.instance_id, ready=ready,
                              reason=reason, time=time.time(),
                              reconnects=self.bus.reconnects if self.bus is not None else 0)
        self.fill_heartbeat(beat)
        if self.bus is not None and self.bus.is_connected:
            try:
                await self.bus.publish(self.subjects.heartbeat, beat)
            except Exception as exc:  # a reconnecting client refuses publishes: skip a beat
                self.log.debug("heartbeat not sent", error=str(exc))


def run_service(service: Service) -> None:
    try:
        uvloop.run(service.run())
    except BusError as exc:   # NATS unreachable at start: say why in one line, exit non-zero
        service.log.error("cannot join the mesh", error=str(exc))
        raise SystemExit(1) from None
