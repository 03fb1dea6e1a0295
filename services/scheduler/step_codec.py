"""SchedulerOutput -> StepInput and StepOutput -> RunnerOutput, column-wise, in upb
(services/common/wire_pb): ~10 us a step where betterproto took ~1 ms."""

from __future__ import annotations

from itertools import chain
from typing import cast

from services.common import wire_pb
from services.common.packing import pack_int32, unpack_int32, unpack_strings
from services.scheduler.core.output import RunnerOutput, SchedulerOutput
from services.scheduler.kv.codec import decode_kv_connector_output, encode_kv_connector_metadata


def encode_step_input(output: SchedulerOutput, reset: bool = False) -> wire_pb.StepInput:
    cached = output.cached
    step = wire_pb.StepInput(
        step=output.step,
        new_requests=[
            wire_pb.NewRequestData(
                handle=new.handle, request_id=new.request_id,
                token_ids=pack_int32(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                block_ids=pack_int32(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                # The core carries them opaque (core/output.py); the service put them there.
                sampling=cast(wire_pb.SamplingParams, new.sampling),
                lora=cast(wire_pb.LoraRequest | None, new.lora),
                mm_items=cast(list[wire_pb.MultiModalItem], new.mm_items or []))
            for new in output.new_requests
        ],
        cached_handles=pack_int32(cached.handles),
        cached_num_new_blocks=pack_int32([len(ids) for ids in cached.new_block_ids]),
        cached_new_block_ids=pack_int32(list(chain.from_iterable(cached.new_block_ids))),
        cached_num_computed_tokens=pack_int32(cached.num_computed_tokens),
        num_scheduled_tokens=pack_int32(output.num_scheduled_tokens),
        finished_handles=pack_int32(output.finished_handles),
        reset=reset,
    )
    if output.kv_connector_metadata:
        encode_kv_connector_metadata(output.kv_connector_metadata, step)
    checkpoints = output.state_checkpoints
    if checkpoints:
        step.state_restore_handles = pack_int32(checkpoints.restore_handles)
        step.state_restore_slots = pack_int32(checkpoints.restore_slots)
        step.state_save_handles = pack_int32(checkpoints.save_handles)
        step.state_save_slots = pack_int32(checkpoints.save_slots)
    return step


def decode_step_output(message: wire_pb.StepOutput) -> RunnerOutput:
    rejected = dict(zip(unpack_int32(message.rejected_handles).tolist(),
                        unpack_strings(message.rejected_reasons)))
    return RunnerOutput(handles=unpack_int32(message.handles).tolist(),
                        sampled_token_ids=unpack_int32(message.sampled_token_ids).tolist(),
                        kv_connector_output=decode_kv_connector_output(message),
                        rejected=rejected,
                        deferred=set(unpack_int32(message.deferred_handles).tolist()),
                        num_spec_tokens=dict(zip(
                            unpack_int32(message.draft_handles).tolist(),
                            unpack_int32(message.num_draft_tokens).tolist())))
