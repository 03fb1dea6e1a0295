"""The KV connector's columns of StepInput / StepOutput (proto/engine.proto), packed as the
wire rules ask: one column per field, block hashes concatenated, nodes named once."""

from __future__ import annotations

from itertools import chain

from services.common import wire_pb
from services.common.packing import pack_int32, pack_strings, pack_uint8, unpack_int32, unpack_uint8
from services.scheduler.core.kv_connector.metadata import KVConnectorMetadata, KVConnectorOutput


def encode_kv_connector_metadata(meta: KVConnectorMetadata, step: wire_pb.StepInput) -> None:
    nodes: dict[str, int] = {}

    def node_id(address: str) -> int:
        return nodes.setdefault(address, len(nodes))

    if meta.loads:
        step.kv_load_handles = pack_int32([load.handle for load in meta.loads])
        step.kv_load_num_blocks = pack_int32([len(load.block_ids) for load in meta.loads])
        step.kv_load_block_ids = pack_int32(list(chain.from_iterable(
            load.block_ids for load in meta.loads)))
        step.kv_load_block_hashes = b"".join(chain.from_iterable(
            load.block_hashes for load in meta.loads))
        step.kv_load_node_ids = pack_int32([node_id(node) for load in meta.loads
                                            for node in load.nodes])
    if meta.saves:
        step.kv_save_ids = pack_int32([save.save_id for save in meta.saves])
        step.kv_save_num_blocks = pack_int32([len(save.block_ids) for save in meta.saves])
        step.kv_save_node_ids = pack_int32([node_id(save.node) for save in meta.saves])
        step.kv_save_before_forward = pack_uint8([save.before_forward for save in meta.saves])
        step.kv_save_block_ids = pack_int32(list(chain.from_iterable(
            save.block_ids for save in meta.saves)))
        step.kv_save_block_hashes = b"".join(chain.from_iterable(
            save.block_hashes for save in meta.saves))
    step.kv_nodes = pack_strings(list(nodes))


def decode_kv_connector_output(message: wire_pb.StepOutput) -> KVConnectorOutput | None:
    if not message.kv_loaded_handles and not message.kv_saved_ids:
        return None
    return KVConnectorOutput(
        loaded=list(zip(unpack_int32(message.kv_loaded_handles).tolist(),
                        unpack_int32(message.kv_loaded_num_blocks).tolist(),
                        map(bool, unpack_uint8(message.kv_load_failed).tolist()))),
        saved=list(zip(unpack_int32(message.kv_saved_ids).tolist(),
                       map(lambda failed: not failed,
                           unpack_uint8(message.kv_save_failed).tolist()))))
