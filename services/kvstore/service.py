"""The kvstore service: one node of the KV block store. It serves the gRPC data plane,
keeps its liveness key and index entries in Redis, sweeps the entries of nodes that went
away, and publishes its tiers' KV events. Several nodes may run; each is independent."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from grpclib.server import Server

from services.common.kv_data_plane import GRPC_CONFIG, server_tls
from services.common.kv_event_stream import KVEventPublisher
from services.common.kv_index import KVIndex
from services.common.metrics import KVStoreMetrics
from services.common.service import Service
from services.kvstore.block_store import BlockStore, Change, Medium
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.settings import KVStoreSettings
from services.kvstore.tiers import DiskTier


class KVStoreService(Service):
    name = "kvstore"

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.settings: KVStoreSettings = settings
        self.metrics = KVStoreMetrics(self.registry)
        disk = (DiskTier(Path(settings.kv_disk_dir), settings.kv_disk_bytes)
                if settings.kv_disk_dir else None)
        self.store = BlockStore(settings.kv_cpu_bytes, disk)
        self.index: KVIndex | None = None
        self.servicer: KVStoreServicer | None = None
        self.server: Server | None = None
        self.address = ""
        self._publishers: dict[str, KVEventPublisher] = {}
        self._index_ok = False

    async def setup(self) -> None:
        s = self.settings
        if s.redis_url:
            self.index = KVIndex.connect(s.redis_url, s.namespace)
        self.servicer = KVStoreServicer(
            self.store, self.instance_id, self.metrics, self.index, s.kv_index_ttl_s,
            self._publisher_for if s.enable_kv_events else None)
        self.metrics.tier_capacity_bytes.labels("cpu").set(s.kv_cpu_bytes)
        if self.store.disk is not None:
            self.metrics.tier_capacity_bytes.labels("disk").set(s.kv_disk_bytes)
        # A socket bound here tells the port even when --grpc-port is 0 (any free port).
        sock = socket.socket(socket.AF_INET6 if ":" in s.grpc_host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.grpc_host, s.grpc_port))
        self.server = Server([self.servicer], config=GRPC_CONFIG)
        tls = server_tls(s)
        await self.server.start(sock=sock, ssl=tls)
        self.address = s.advertise_address or f"{s.grpc_host}:{sock.getsockname()[1]}"
        await self._adopt_disk_blocks()
        self.background.spawn(self._keep_registered(), name="keep registered in the index")
        self.log.info("kvstore serving", address=self.address, tls=tls is not None,
                      mutual_tls=tls is not None and bool(s.kv_tls_ca_file),
                      cpu_bytes=s.kv_cpu_bytes,
                      disk_dir=s.kv_disk_dir or None, index=bool(self.index))

    def readiness(self) -> tuple[bool, str]:
        if self.index is not None and not self._index_ok:
            return False, "Redis index not reachable"
        return True, ""

    async def drain(self) -> None:
        # Leave the index first: schedulers stop sending loads here, in-flight calls finish.
        if self.index is not None:
            try:
                await self.index.unregister_node(self.instance_id)
            except Exception as exc:
                self.log.warning("could not leave the index", error=str(exc))
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def close(self) -> None:
        for publisher in self._publishers.values():
            await publisher.close()
        if self.index is not None:
            await self.index.close()

    async def _keep_registered(self) -> None:
        """Refreshes this node's liveness key and sweeps nodes whose key expired."""
        ttl = self.settings.kv_node_ttl_s
        while self.index is not None:
            try:
                await self.index.register_node(self.instance_id, self.address, ttl)
                dropped = await self.index.sweep_dead_nodes(self.instance_id)
                if dropped:
                    self.log.info("dropped the index entries of nodes that went away",
                                  num_entries=dropped)
                self._index_ok = True
            except Exception as exc:
                if self._index_ok:
                    self.log.warning("Redis index unreachable", error=str(exc))
                self._index_ok = False
            await asyncio.sleep(ttl / 5)

    async def _adopt_disk_blocks(self) -> None:
        adopted = self.store.adopt_disk()
        if adopted and self.servicer is not None:
            self.log.info("kept the disk tier of a previous run", num_blocks=len(adopted))
            await self.servicer.apply_changes(
                [Change(key, True, Medium.DISK, size, checksum) for key, size, checksum in adopted])

    async def _publisher_for(self, fingerprint: str) -> KVEventPublisher:
        publisher = self._publishers.get(fingerprint)
        if publisher is None:
            assert self.servicer is not None
            servicer = self.servicer
            publisher = KVEventPublisher(
                self.connected_bus, self.subjects, f"{self.instance_id}-{fingerprint}",
                lambda: servicer.snapshot_events(fingerprint), fingerprint,
                self.settings.jetstream_replicas)
            self._publishers[fingerprint] = publisher
            await publisher.start()
        return publisher
