"""Responses kept in JetStream, shared by every gateway replica:

- records: a KV bucket, response id -> the response object, its owner, and the conversation
  a later turn continues (`previous_response_id`), kept RECORD_TTL_S;
- events: a stream of every background response's events, in order, one subject per
  response, so a client resumes a stream through any gateway (`starting_after`).

Creating what exists is a no-op, so whoever comes first creates them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import nats.errors
import nats.js.errors as js_errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from services.common.jetstream import ensure_key_value, ensure_window_stream
from services.common.subjects import Subjects
from services.frontend.openai.responses_api.items import Message
from services.frontend.openai.responses_api.response_output import Event
from services.frontend.openai.responses_api.response_run import TERMINAL_EVENTS

RECORD_TTL_S = 30 * 24 * 3600   # OpenAI keeps stored responses 30 days
EVENTS_MAX_AGE_S = 24 * 3600    # a background stream is resumable for a day
EVENTS_MAX_BYTES = 1 << 30
READ_TIMEOUT_S = 5.0            # for one stored event, once the stream says it is there


@dataclass
class ResponseRecord:
    owner: str                                   # the API key id that made it ("" without keys)
    response: dict[str, Any]                     # the response object, as GET answers it
    conversation: list[Message] = field(default_factory=list)   # history + this input
    output_messages: list[Message] = field(default_factory=list)
    # A background response: the gateway running it, and what another needs to take it over
    # (resume.py): the request body and what its generation was submitted as.
    input_items: list[dict[str, Any]] = field(default_factory=list)   # this input, listed
    gateway: str = ""
    body: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    revision: int = field(default=0, compare=False)   # of the stored entry; not stored

    @property
    def status(self) -> str:
        return str(self.response["status"])

    def next_conversation(self) -> list[Message]:
        """What a response continuing this one starts from."""
        return self.conversation + self.output_messages

    def to_bytes(self) -> bytes:
        fields = asdict(self)
        del fields["revision"]
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, revision: int) -> ResponseRecord:
        return cls(**json.loads(data), revision=revision)


class ResponseStore:
    def __init__(self, js: JetStreamContext, subjects: Subjects, records: KeyValue) -> None:
        self._js = js
        self._subjects = subjects
        self._records = records

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects,
                   replicas: int = 1) -> ResponseStore:
        """The store, creating what is missing on `replicas` nodes (--jetstream-replicas)."""
        records = await ensure_key_value(js, subjects.responses_bucket, RECORD_TTL_S, replicas)
        await ensure_window_stream(js, subjects.response_events_stream,
                                   [subjects.response_events_all], EVENTS_MAX_AGE_S,
                                   EVENTS_MAX_BYTES, replicas)
        return cls(js, subjects, records)

    async def put(self, response_id: str, record: ResponseRecord) -> None:
        await self._records.put(response_id, record.to_bytes())

    async def get(self, response_id: str) -> ResponseRecord | None:
        try:
            entry = await self._records.get(response_id)
        except (js_errors.KeyNotFoundError, js_errors.KeyDeletedError):
            return None
        return ResponseRecord.from_bytes(entry.value, entry.revision or 0) \
            if entry.value else None

    async def claim(self, response_id: str, record: ResponseRecord, gateway: str) -> bool:
        """Makes `gateway` the one running the response, if the record is still as read
        (compare-and-set: of gateways that find the runner gone, one takes over)."""
        record.gateway = gateway
        try:
            await self._records.update(response_id, record.to_bytes(), last=record.revision)
        except js_errors.KeyWrongLastSequenceError:
            return False
        return True

    async def delete(self, response_id: str) -> None:
        await self._records.purge(response_id)

    async def publish_event(self, response_id: str, event: Event,
                            headers: dict[str, str] | None = None) -> None:
        await self._js.publish(self._subjects.response_events(response_id),
                               json.dumps(event, separators=(",", ":")).encode(),
                               headers=headers)

    async def stored_events(self, response_id: str) -> list[tuple[Event, dict[str, str]]]:
        """Every event stored for the response so far, with its headers, in order."""
        subject = self._subjects.response_events(response_id)
        try:
            last = await self._js.get_last_msg(self._subjects.response_events_stream, subject)
        except js_errors.NotFoundError:
            return []
        subscription = await self._js.subscribe(subject, ordered_consumer=True,
                                                deliver_policy=api.DeliverPolicy.ALL)
        events = []
        try:
            while True:
                message = await subscription.next_msg(timeout=READ_TIMEOUT_S)
                events.append((json.loads(message.data), dict(message.headers or {})))
                if message.metadata.sequence.stream >= last.seq:
                    return events
        finally:
            await subscription.unsubscribe()

    async def follow(self, response_id: str, starting_after: int,
                     idle_s: float) -> AsyncIterator[Event | None]:
        """The response's events after `starting_after`, as stored and then as they come,
        through its terminal event; None after each `idle_s` without one (the caller sends
        a keep-alive and checks the run still has someone behind it)."""
        subscription = await self._js.subscribe(
            self._subjects.response_events(response_id), ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL)
        try:
            while True:
                try:
                    message = await subscription.next_msg(timeout=idle_s)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    yield None
                    continue
                event = json.loads(message.data)
                # NOTE: a gateway that took the run over publishes again what the one before
                # it published past its last checkpoint: the same events, the same numbers.
                if event["sequence_number"] > starting_after:
                    starting_after = event["sequence_number"]
                    yield event
                if event["type"] in TERMINAL_EVENTS:
                    return
        finally:
            await subscription.unsubscribe()
