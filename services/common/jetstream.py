"""Creating the JetStream streams and KV buckets the mesh keeps: whoever comes first creates
one, and creating what exists is a no-op."""

from __future__ import annotations

import nats.js.errors as js_errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue


async def ensure_window_stream(js: JetStreamContext, name: str, subjects: list[str],
                               max_age_s: float, max_bytes: int, replicas: int = 1) -> None:
    """A stream that keeps a bounded window (the oldest messages go first), file-backed so
    the window survives a NATS restart on its store directory (docs/operations.md), on
    `replicas` nodes of a cluster (--jetstream-replicas)."""
    try:
        await js.stream_info(name)
    except js_errors.NotFoundError:
        await js.add_stream(api.StreamConfig(
            name=name, subjects=subjects, max_age=max_age_s, max_bytes=max_bytes,
            discard=api.DiscardPolicy.OLD, storage=api.StorageType.FILE,
            num_replicas=replicas))


async def ensure_key_value(js: JetStreamContext, bucket: str, ttl_s: float | None,
                           replicas: int = 1) -> KeyValue:
    """A KV bucket keeping each key's latest value (for `ttl_s`, None: for ever)."""
    try:
        return await js.key_value(bucket)
    except js_errors.BucketNotFoundError:
        return await js.create_key_value(bucket=bucket, history=1, ttl=ttl_s,
                                         replicas=replicas)
