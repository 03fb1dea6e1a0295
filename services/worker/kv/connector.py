"""The worker side of the KV connector, after vLLM's KVConnectorBase_V1 (worker role).

Each step the scheduler names blocks to load from the kvstore and blocks to save to it
(StepInput.kv_*). In the model runner's thread, between forward passes:
- before the forward pass: loads of requests that ended are cancelled; blocks the pool is
  about to reuse (save mode on_evict) are copied out;
- after it: newly computed blocks are copied out (write-through); loads that arrived are
  copied into the KV tensors and reported, so a request runs only once its KV is in place.
The network work (gRPC Get / Put, checksums) runs on the transfer thread; the copies here are
the only part a step waits for. A block payload is one block of every layer, K then V:
[layers, 2, block_size, kv_heads, head_dim] in the cache dtype (the fingerprint's layout).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import (
    pack_int32,
    pack_uint8,
    unpack_int32,
    unpack_strings,
    unpack_uint8,
)
from services.worker.attention.backend import KVCache
from services.worker.kv.kv_cache import KVCacheSpec
from services.worker.kv.transfer import KVTransferThread, LoadResult, SaveResult
from services.worker.runner.step_hooks import StepHooks

LAYOUT = "layers,kv,block,heads,dim"
_IDLE_WAIT_S = 0.02   # an empty step with transfers in flight waits this long for one


def kv_fingerprint(model_dir: Path, spec: KVCacheSpec, quantization: str = "none") -> str:
    """Names the bytes of this worker's KV blocks: the model (its config, and the size, head
    and tail of each weight file: different weights never share a fingerprint in practice),
    how its weights run (a quantized model computes other KV), the cache dtype, the block
    size and the layout."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(1 << 20)
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
        digest.update(f"{path.name}:{size}".encode() + head + tail)
    digest.update(f"{spec.dtype}|{spec.block_size}|{spec.num_layers}|{spec.num_kv_heads}|"
                  f"{spec.head_dim}|{LAYOUT}".encode())
    if quantization != "none":   # unchanged for unquantized engines: their stores stay valid
        digest.update(f"|quantization={quantization}".encode())
    return digest.hexdigest()[:24]


class WorkerKVConnector(StepHooks):
    def __init__(self, kv_caches: list[KVCache], spec: KVCacheSpec, device: torch.device,
                 transfer: KVTransferThread) -> None:
        self.kv_caches = kv_caches
        self.spec = spec
        self.device = device
        self.transfer = transfer
        self._block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads,
                             spec.head_dim)
        self._loads: dict[int, tuple[Future[None], list[int]]] = {}   # handle -> (load, ids)
        self._num_saves_in_flight = 0
        self._loaded: list[tuple[int, int, bool]] = []   # reports: handle, blocks, failed
        self._saved: list[tuple[int, bool]] = []         # reports: save id, ok

    def before_forward(self, step: wire_pb.StepInput) -> None:
        ended = (list(self._loads) if step.reset
                 else unpack_int32(step.finished_handles).tolist())
        for handle in ended:
            load = self._loads.pop(handle, None)
            if load is not None:
                load[0].cancel()
        self._save(step, before_forward=True)
        self._start_loads(step)

    def finish_step(self, step: wire_pb.StepInput, out: wire_pb.StepOutput,
                    ran_forward: bool) -> None:
        """Copies out what the forward pass computed (write-through saves), then applies the
        transfers that ended and reports them in `out`. A step that ran nothing while
        transfers are in flight waits briefly for one, so a scheduler polling for its loads
        neither spins nor waits long."""
        if ran_forward:
            self._save(step, before_forward=False)
        is_idle = not ran_forward
        if is_idle and (self._loads or self._num_saves_in_flight):
            self.transfer.has_results.wait(_IDLE_WAIT_S)
        self._collect()
        if self._loaded:
            handles, num_blocks, failed = zip(*self._loaded)
            out.kv_loaded_handles = pack_int32(handles)
            out.kv_loaded_num_blocks = pack_int32(num_blocks)
            out.kv_load_failed = pack_uint8(failed)
            self._loaded = []
        if self._saved:
            save_ids, ok = zip(*self._saved)
            out.kv_saved_ids = pack_int32(save_ids)
            out.kv_save_failed = pack_uint8([not o for o in ok])
            self._saved = []

    def close(self) -> None:
        self.transfer.close()

    # ---- loads
    def _start_loads(self, step: wire_pb.StepInput) -> None:
        if not step.kv_load_handles:
            return
        nodes = unpack_strings(step.kv_nodes)
        node_ids = unpack_int32(step.kv_load_node_ids).tolist()
        groups = _groups(step.kv_load_num_blocks, step.kv_load_block_ids,
                         step.kv_load_block_hashes)
        offset = 0
        for handle, (block_ids, hashes) in zip(unpack_int32(step.kv_load_handles).tolist(),
                                               groups):
            block_nodes = [nodes[i] for i in node_ids[offset:offset + len(block_ids)]]
            offset += len(block_ids)
            self._loads[handle] = (self.transfer.load(handle, hashes, block_nodes), block_ids)

    def _collect(self) -> None:
        for result in self.transfer.take_results():
            if isinstance(result, SaveResult):
                self._num_saves_in_flight -= 1
                self._saved.append((result.save_id, result.ok))
                continue
            load = self._loads.pop(result.handle, None)
            if load is None:
                continue   # cancelled: its blocks may belong to another request by now
            self._copy_in(load[1], result)
            self._loaded.append((result.handle, len(result.payloads), result.failed))

    def _copy_in(self, block_ids: list[int], result: LoadResult) -> None:
        if not result.payloads:
            return
        data = np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in result.payloads])
        blocks = (torch.from_numpy(data).view(self.spec.dtype)
                  .reshape(len(result.payloads), *self._block_shape).to(self.device))
        index = torch.tensor(block_ids[:len(result.payloads)], device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.key[index] = blocks[:, layer, 0]
            cache.value[index] = blocks[:, layer, 1]

    # ---- saves
    def _save(self, step: wire_pb.StepInput, before_forward: bool) -> None:
        if not step.kv_save_ids:
            return
        nodes = unpack_strings(step.kv_nodes)
        groups = _groups(step.kv_save_num_blocks, step.kv_save_block_ids,
                         step.kv_save_block_hashes)
        for save_id, node_id, is_before, (block_ids, hashes) in zip(
                unpack_int32(step.kv_save_ids).tolist(),
                unpack_int32(step.kv_save_node_ids).tolist(),
                unpack_uint8(step.kv_save_before_forward).tolist(), groups):
            if bool(is_before) is before_forward:
                self._num_saves_in_flight += 1
                self.transfer.save(save_id, nodes[node_id], hashes, self._copy_out(block_ids))

    def _copy_out(self, block_ids: list[int]) -> np.ndarray:
        """uint8 [blocks, block bytes]: a copy, so the pool may reuse the blocks at once."""
        index = torch.tensor(block_ids, device=self.device)
        blocks = torch.empty((len(block_ids), *self._block_shape), dtype=self.spec.dtype,
                             device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            blocks[:, layer, 0] = cache.key[index]
            blocks[:, layer, 1] = cache.value[index]
        return blocks.view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()


def _groups(num_blocks: bytes, block_ids: bytes, hashes: bytes) -> list[tuple[list[int], list[bytes]]]:
    """Splits concatenated block columns into one (block ids, hashes) per group."""
    counts = unpack_int32(num_blocks).tolist()
    ids = unpack_int32(block_ids).tolist()
    hash_len = len(hashes) // max(len(ids), 1)
    groups, start = [], 0
    for count in counts:
        end = start + count
        groups.append((ids[start:end], [hashes[i * hash_len:(i + 1) * hash_len]
                                        for i in range(start, end)]))
        start = end
    return groups
