"""The kvstore's settings."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv_data_plane import KVTLSSettings
from services.common.kv_index import KVIndexSettings
from services.common.settings import CommonSettings, setting


@dataclass
class KVStoreSettings(CommonSettings, KVIndexSettings, KVTLSSettings):
    grpc_host: str = setting("127.0.0.1", "Bind address of the gRPC data plane")
    grpc_port: int = setting(0, "Port of the gRPC data plane (0: any free port)")
    advertise_address: str = setting("", "host:port workers use to reach this node (default: "
                                     "--grpc-host and the bound port)")
    kv_cpu_bytes: int = setting(2 * 1024**3, "Bytes of KV blocks kept in memory (LRU beyond)")
    kv_disk_dir: str = setting("", "Directory of the disk tier (empty: no disk tier); blocks "
                               "found there at start are kept")
    kv_disk_bytes: int = setting(16 * 1024**3, "Bytes of KV blocks kept on disk (LRU beyond)")
    kv_index_ttl_s: float = setting(3600.0, "Index entries expire this long after their last "
                                    "write or read")
    kv_node_ttl_s: float = setting(5.0, "A node whose liveness key is this old is gone: its "
                                   "index entries are dropped")
    enable_kv_events: bool = setting(True, "Publish BlockStored / BlockRemoved events of the "
                                     "tiers on JetStream")
