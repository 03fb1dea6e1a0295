"""Resuming a background response whose gateway stopped.

The gateway running a background response stores, beside the events that close each
output delta, a checkpoint: the output tokens and the text those events cover (message
headers, so clients never see them), and in the response's record what the run's
generation was submitted as. Another gateway rebuilds the run from these — the chat output
replayed to the checkpoint, the next event numbered after it, the items under the ids
already streamed — and moves the generation to itself by migration.py's path: the prompt
plus the checkpoint's tokens go to a live engine, whose tokenizer skips the text already
sent. Greedy output continues as an undisturbed run; events the first gateway published
past its last checkpoint come again with the same numbers, and followers skip numbers they
have seen.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any

from services.common import wire
from services.common.packing import pack_int32, unpack_int32
from services.frontend.engine_client.generation import Generation
from services.frontend.openai.responses_api.response_output import Event

TOKENS_HEADER = "Mesh-Output-Tokens"   # packed int32, base64: tokens since the last checkpoint
TEXT_HEADER = "Mesh-Output-Text"       # utf-8, base64: their text, as streamed


def checkpoint_headers(token_ids: list[int], text: str) -> dict[str, str]:
    return {TOKENS_HEADER: base64.b64encode(pack_int32(token_ids)).decode(),
            TEXT_HEADER: base64.b64encode(text.encode()).decode()}


@dataclass
class Checkpoint:
    """How far a response's stored events go: the last event a checkpoint closed, the output
    tokens and text up to it, and the ids of the items streamed (by output index)."""
    sequence: int = -1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    item_ids: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, events: list[tuple[Event, dict[str, str]]]) -> Checkpoint:
        checkpoint = cls()
        for event, headers in events:
            if event["type"] == "response.output_item.added":
                checkpoint.item_ids[event["output_index"]] = event["item"]["id"]
            if TOKENS_HEADER in headers:
                checkpoint.sequence = event["sequence_number"]
                checkpoint.token_ids += unpack_int32(
                    base64.b64decode(headers[TOKENS_HEADER])).tolist()
                checkpoint.text += base64.b64decode(headers[TEXT_HEADER]).decode()
        return checkpoint


@dataclass
class ResumeState:
    """What a response's generation was submitted as, kept in its record."""
    request: str        # wire.GenerateRequest, base64
    detokenize: str     # wire.DetokenizeParams, base64
    model: str
    engine_id: str
    scheduler_id: str

    @classmethod
    def of(cls, generation: Generation) -> ResumeState:
        assert generation.request is not None and generation.detokenize is not None
        return cls(base64.b64encode(bytes(generation.request)).decode(),
                   base64.b64encode(bytes(generation.detokenize)).decode(),
                   generation.model, generation.engine_id, generation.scheduler_id)

    def generation(self, gateway_id: str, checkpoint: Checkpoint) -> Generation:
        """The generation as the stopped gateway had it at the checkpoint, its output now
        addressed to `gateway_id`."""
        request = wire.GenerateRequest().parse(base64.b64decode(self.request))
        detokenize = wire.DetokenizeParams().parse(base64.b64decode(self.detokenize))
        detokenize.gateway_id = gateway_id
        return Generation(request.request_id, 0, self.engine_id, self.scheduler_id,
                          request.tokenizer_id, asyncio.Queue(), request=request,
                          detokenize=detokenize, model=self.model,
                          output_token_ids=list(checkpoint.token_ids),
                          num_chars=len(checkpoint.text))

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()
