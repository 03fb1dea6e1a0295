"""What the KV connector's scheduler side and the worker exchange each step, and the
connector's modes. Plain data, so the step's output (core/output.py) can name it without
importing the connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class KVRole(str, Enum):
    BOTH = "both"            # loads and saves
    PRODUCER = "producer"    # prefill engine: saves (and may load shared prefixes)
    CONSUMER = "consumer"    # decode engine: loads, never saves


class LoadFailurePolicy(str, Enum):
    RECOMPUTE = "recompute"  # keep the blocks that arrived intact, compute the rest
    FAIL = "fail"            # finish the request with an error


class SaveMode(str, Enum):
    ON_REUSE = "on_reuse"             # cached blocks, when a later request first hits them
    WRITE_THROUGH = "write_through"   # every full prompt block, as soon as it is computed
    ON_EVICT = "on_evict"             # cached blocks, when the pool reuses them


@dataclass(slots=True)
class KVLoad:
    handle: int
    block_ids: list[int]
    block_hashes: list[bytes]
    nodes: list[str]             # per block: the kvstore address that holds it


@dataclass(slots=True)
class KVSave:
    save_id: int
    block_ids: list[int]
    block_hashes: list[bytes]
    node: str
    before_forward: bool         # evicted blocks: copied out before this step overwrites them


@dataclass(slots=True)
class KVConnectorMetadata:
    """This step's transfers, for the worker (encoded into StepInput by step_codec)."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker reported in one StepOutput."""

    loaded: list[tuple[int, int, bool]] = field(default_factory=list)  # handle, blocks, failed
    saved: list[tuple[int, bool]] = field(default_factory=list)        # save id, ok
