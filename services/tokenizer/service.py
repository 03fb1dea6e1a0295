"""The tokenizer service: encodes prompts for the gateway (a stateless queue group) and
turns each engine step's token deltas into text for the gateways (stateful, per instance:
it detokenizes the requests it encoded)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from contextlib import AsyncExitStack
from typing import Any

import betterproto
from nats.aio.subscription import Subscription

from services.common import wire, wire_pb
from services.common.grammar.grammar_cache import tokenizer_info
from services.common.logs import request_log_context
from services.common.metrics import TokenizerMetrics
from services.common.model_files import resolve_model
from services.common.packing import (
    pack_int32,
    pack_strings,
    unpack_int32,
    unpack_strings,
    unpack_uint8,
)
from services.common.service import Service
from services.common.subjects import TOKENIZER_QUEUE
from services.tokenizer.chat_images import ChatImages, template_messages
from services.tokenizer.detokenizer import RequestDetokenizer
from services.tokenizer.grammar_validator import GrammarValidator
from services.tokenizer.multimodal import MediaError
from services.tokenizer.output_batcher import OutputBatcher
from services.tokenizer.settings import TokenizerSettings
from services.tokenizer.text_codec import InvalidPrompt, TextCodec

FinishReason = wire.FinishReason
DRAIN_REPORT_INTERVAL_S = 5.0


class TokenizerService(Service):
    name = "tokenizer"

    def __init__(self, settings: TokenizerSettings) -> None:
        super().__init__(settings)
        self.settings: TokenizerSettings = settings
        self.codec: TextCodec | None = None
        self.grammars: GrammarValidator | None = None
        self.images: ChatImages | None = None
        self._resources = AsyncExitStack()          # what setup opened, closed by close()
        self.states: dict[str, RequestDetokenizer] = {}
        self.clients_seen: dict[str, float] = {}   # gateway / batch runner id -> last heartbeat
        self._new_work: list[Subscription] = []      # encode/detokenize queue subscriptions
        self.metrics = TokenizerMetrics(self.registry)
        self.metrics.detokenizer_states.set_function(lambda: len(self.states))

    async def setup(self) -> None:
        files = await asyncio.to_thread(resolve_model, self.settings.model)
        started = time.monotonic()
        self.codec = await asyncio.to_thread(TextCodec, files.hf_dir,
                                             self.settings.chat_template)
        self.log.info("tokenizer loaded", model=str(files.source), vocab_size=self.codec.vocab_size,
                      seconds=round(time.monotonic() - started, 2))
        hf_tokenizer = self.codec.hf
        self.grammars = GrammarValidator(lambda: tokenizer_info(hf_tokenizer), self.registry,
                                         self.settings.grammar_cache_size,
                                         self.settings.grammar_compile_timeout_s)
        bus = self.connected_bus
        self.images = await self._resources.enter_async_context(ChatImages.open(
            self.settings, self.settings.served_model_name or str(files.source), files.hf_dir,
            hf_tokenizer, bus.client.jetstream(), self.subjects,
            self.settings.jetstream_replicas))
        self.log.info("images", accepted=self.images.accepts_images)
        self._new_work = [
            # NOTE: concurrent: a prompt's images may take seconds to download.
            await bus.serve(self.subjects.tokenizer_encode, wire.EncodeRequest, self.on_encode,
                            queue=TOKENIZER_QUEUE, concurrent=True),
            await bus.serve(self.subjects.tokenizer_detokenize, wire.DetokenizeRequest,
                            self.on_detokenize, queue=TOKENIZER_QUEUE)]
        await bus.subscribe(self.subjects.tokenizer_deltas(self.instance_id),
                            wire_pb.RequestDeltaBatch, self.on_deltas)
        await bus.subscribe(self.subjects.tokenizer_release(self.instance_id),
                            wire.ReleaseRequest, self.on_release)
        await bus.subscribe(self.subjects.heartbeat, wire.Heartbeat, self.on_heartbeat)
        self.background.spawn(self._expire_states_loop(), name="expire detokenizer states")
        self.background.spawn(self._drop_orphans_loop(), name="drop orphaned states")

    async def drain(self) -> None:
        """Leaves new prompts to the other tokenizers and keeps detokenizing the requests
        it holds until they end (past --drain-timeout-s, gateways move what is left)."""
        for subscription in self._new_work:
            await subscription.unsubscribe()
        if self.states:
            self.log.info("finishing the requests held here", count=len(self.states))
        next_report = time.monotonic() + DRAIN_REPORT_INTERVAL_S
        while self.states:
            await asyncio.sleep(0.05)
            if self.states and time.monotonic() >= next_report:
                # Says what a slow drain waits on (a request whose engine went quiet, say).
                self.log.info("still finishing", count=len(self.states),
                              requests={rid: {"engine": s.engine_id, "output": s.has_output}
                                        for rid, s in list(self.states.items())[:8]})
                next_report += DRAIN_REPORT_INTERVAL_S

    def readiness(self) -> tuple[bool, str]:
        return (True, "") if self.codec is not None else (False, "loading tokenizer")

    async def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        await self._resources.aclose()

    # ---- encoding (request/reply)

    async def on_encode(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        with request_log_context(",".join(request.request_ids)):
            if request.grammar.kind == wire.GrammarKind.NONE:
                return await self._encode_reply(request)
            assert self.grammars is not None
            error = await self.grammars.error_of(request.grammar)
            if error is not None:
                return wire.EncodeReply(grammar_error=error, tokenizer_id=self.instance_id)
            reply = await self._encode_reply(request)
            if request.grammar.reasoning.end:
                # NOTE: sent back only when there are markers to resolve: a tool schema the
                # gateway already holds would otherwise cross NATS twice.
                assert self.codec is not None
                reply.grammar = engine_grammar(request.grammar, self.codec)
            return reply

    async def _encode_reply(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        assert self.codec is not None
        started = time.perf_counter()
        try:
            token_ids, mm_items = await self._encode(request)
        except InvalidPrompt as exc:
            return wire.EncodeReply(error=str(exc), tokenizer_id=self.instance_id)
        except MediaError as exc:
            return wire.EncodeReply(error=exc.message, error_param=exc.param or "",
                                    tokenizer_id=self.instance_id)
        self.metrics.encode_time.observe(time.perf_counter() - started)
        resume_ids = unpack_int32(request.resume_token_ids).tolist()
        for request_id in request.request_ids:
            state = RequestDetokenizer(request_id, request.detokenize, len(token_ids))
            if resume_ids:
                state.resume(self.codec, resume_ids, request.resume_num_chars)
            self.states[request_id] = state
        strings = self.codec.raw_token_strings(token_ids) if request.return_token_strings else []
        return wire.EncodeReply(token_ids=pack_int32(token_ids), tokenizer_id=self.instance_id,
                                token_strings=strings, mm_items=mm_items)

    async def _encode(self, request: wire.EncodeRequest,
                      ) -> tuple[list[int], list[wire.MultiModalItem]]:
        """The prompt's token ids, and its images (a chat's image parts) expanded in them."""
        assert self.codec is not None
        kind, value = betterproto.which_one_of(request, "input")
        if kind == "prompt_token_ids":
            token_ids = unpack_int32(value).tolist()
            bad = [t for t in token_ids if not 0 <= t < self.codec.vocab_size]
            if bad:
                raise InvalidPrompt(f"token id {bad[0]} is outside the vocabulary "
                                    f"(0..{self.codec.vocab_size - 1})")
            return token_ids, []
        if kind == "chat":
            return await self._encode_chat(request, value)
        token_ids = self.codec.encode(value or "", add_special_tokens=request.add_special_tokens)
        assert self.images is not None
        self.images.refuse_image_tokens(token_ids)
        return token_ids, []

    async def _encode_chat(self, request: wire.EncodeRequest, chat: wire.ChatMessages,
                           ) -> tuple[list[int], list[wire.MultiModalItem]]:
        assert self.codec is not None and self.images is not None
        messages = [_template_message(m) for m in chat.messages]
        images = await self.images.load(messages)     # before the template: limits first
        text = self.codec.render_chat(template_messages(messages),
                                      request.add_generation_prompt,
                                      request.continue_final_message,
                                      request.chat_template or None,
                                      request.chat_template_kwargs_json,
                                      _json_list(request.tools_json, "tools"))
        # The template already placed the special tokens.
        token_ids = self.codec.encode(text, add_special_tokens=request.add_special_tokens)
        if not images:
            self.images.refuse_image_tokens(token_ids)
            return token_ids, []
        return await self.images.expand(token_ids, images)

    async def on_detokenize(self, request: wire.DetokenizeRequest) -> wire.DetokenizeReply:
        assert self.codec is not None
        token_ids = unpack_int32(request.token_ids).tolist()
        bad = [t for t in token_ids if not 0 <= t < self.codec.vocab_size]
        if bad:
            return wire.DetokenizeReply(error=f"token id {bad[0]} is outside the vocabulary")
        return wire.DetokenizeReply(text=self.codec.decode(token_ids, request.skip_special_tokens))

    # ---- detokenizing (one batch per engine step)

    async def on_deltas(self, batch: wire_pb.RequestDeltaBatch) -> None:
        started = time.perf_counter()
        await self._detokenize(batch)
        self.metrics.delta_batch_time.observe(time.perf_counter() - started)

    async def _detokenize(self, batch: wire_pb.RequestDeltaBatch) -> None:
        assert self.codec is not None
        request_ids = unpack_strings(batch.request_ids)
        counts = unpack_int32(batch.num_new_tokens).tolist()
        tokens = unpack_int32(batch.new_token_ids).tolist()   # a list: rows are sliced one by one
        reasons = unpack_uint8(batch.finish_reasons).tolist()
        cached = unpack_int32(batch.num_cached_tokens).tolist()
        positions = unpack_int32(batch.output_positions).tolist()
        finished = {info.request_id: info for info in batch.finished}
        logprobs = defaultdict(list)
        for entry in batch.logprobs:
            logprobs[entry.request_id].append(entry)

        outputs = OutputBatcher()
        stopped_by_string: list[str] = []
        orphans: list[str] = []
        offset = 0
        for i, request_id in enumerate(request_ids):
            new_tokens = tokens[offset:offset + counts[i]]
            offset += counts[i]
            state = self.states.get(request_id)
            if state is None:
                # Released, expired or its client gone: nobody reads this text. Stop it in
                # the engine too, in case the gateway's own abort never arrived.
                if reasons[i] == FinishReason.NONE:
                    orphans.append(request_id)
                continue
            state.engine_id = batch.engine_id   # the router names it after encoding
            if cached:
                state.num_cached_tokens = cached[i]
            position = state.num_output_tokens
            if positions and counts[i] and state.stream_position(positions[i]) != position:
                # A batch was lost in flight: tell the gateway where the stream broke (it
                # moves the request, continuing from the text it has) and stop it here.
                outputs.add(state.gateway_id, request_id, "", (), None,
                            state.stream_position(positions[i]))
                del self.states[request_id]
                orphans.append(request_id)
                continue
            text, consumed, stop = state.process(self.codec, new_tokens)
            finish: wire_pb.FinishInfo | None = None
            if stop is not None:
                finish = state.finish_info(FinishReason.STOP, stop_reason=stop,
                                           engine_info=finished.get(request_id))
                if reasons[i] == FinishReason.NONE:
                    stopped_by_string.append(request_id)
            elif reasons[i] != FinishReason.NONE:
                text += state.flush()
                finish = state.finish_info(FinishReason(reasons[i]),
                                           engine_info=finished.get(request_id))
            for entry in logprobs.get(request_id, ()):
                outputs.add_logprobs(state.gateway_id, self._name_tokens(entry, consumed))
            outputs.add(state.gateway_id, request_id, text, new_tokens[:consumed],
                        finish, position)
            if finish is not None:
                del self.states[request_id]
        if stopped_by_string:
            await self._abort_in_engine(batch.engine_id, stopped_by_string)
        if orphans:
            await self._abort_in_engine(batch.engine_id, orphans, FinishReason.ABORT)
        for gateway_id, text_batch in outputs.take().items():
            await self.connected_bus.publish(self.subjects.gateway_outputs(gateway_id), text_batch)

    def _name_tokens(self, entry: wire_pb.RequestLogprobs, max_rows: int
                     ) -> wire_pb.TokenLogprobs:
        """Adds the token strings the OpenAI API returns beside each logprob."""
        assert self.codec is not None
        columns = entry.columns
        token_ids = unpack_int32(columns.token_ids)
        if not entry.is_prompt and len(token_ids) > max_rows:  # tokens after a stop string
            columns = trim_rows(columns, max_rows)
            token_ids = token_ids[:max_rows]
        top_ids = unpack_int32(columns.top_token_ids).tolist()
        return wire_pb.TokenLogprobs(
            request_id=entry.request_id, is_prompt=entry.is_prompt, columns=columns,
            token_strings=pack_strings(self.codec.token_strings(token_ids.tolist())),
            top_token_strings=pack_strings(self.codec.token_strings(top_ids)))

    async def _abort_in_engine(self, engine_id: str, request_ids: list[str],
                               reason: wire.FinishReason = FinishReason.STOP) -> None:
        await self.connected_bus.publish(
            self.subjects.engine_abort(engine_id),
            wire.AbortRequest(request_ids=request_ids, reason=reason))

    async def on_release(self, request: wire.ReleaseRequest) -> None:
        for request_id in request.request_ids:
            self.states.pop(request_id, None)

    async def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        if beat.service in ("gateway", "batch"):   # the services that receive text
            self.clients_seen[beat.instance_id] = time.monotonic()

    async def _drop_orphans_loop(self) -> None:
        """Drops the state of requests whose gateway (or batch runner) stopped: their next
        deltas find no state, which aborts them in the engine and frees their blocks."""
        timeout = self.settings.instance_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 2))
            now = time.monotonic()
            gone = {c for c, seen in self.clients_seen.items() if now - seen > timeout}
            if not gone:
                continue
            for client_id in gone:
                del self.clients_seen[client_id]
            orphans = [rid for rid, s in self.states.items() if s.gateway_id in gone]
            for request_id in orphans:
                del self.states[request_id]
            self.log.warning("client gone; dropped its requests", clients=sorted(gone),
                             count=len(orphans))

    async def _expire_states_loop(self) -> None:
        """Drops state of requests that never produced output (their gateway or engine died
        before the first token), so a lost request cannot leak memory here."""
        ttl = self.settings.detokenizer_state_ttl_s
        while True:
            await asyncio.sleep(min(ttl, 60.0))
            now = time.monotonic()
            expired = [rid for rid, s in self.states.items()
                       if not s.has_output and now - s.registered_at > ttl]
            for request_id in expired:
                del self.states[request_id]
            if expired:
                self.log.warning("dropped detokenizer state of silent requests", count=len(expired))


def engine_grammar(grammar: wire.GrammarSpec, codec: TextCodec) -> wire.GrammarSpec:
    """The grammar as engines enforce it: its reasoning markers as this vocabulary's ids
    (the worker finds a reasoning section by them)."""
    markers = grammar.reasoning
    markers.start_token_ids = pack_int32(codec.encode(markers.start, False))
    markers.end_token_ids = pack_int32(codec.encode(markers.end, False))
    return grammar


def trim_rows(columns: wire_pb.LogprobColumns, rows: int) -> wire_pb.LogprobColumns:
    top = columns.num_top
    return wire_pb.LogprobColumns(
        token_ids=columns.token_ids[:4 * rows], logprobs=columns.logprobs[:4 * rows],
        num_top=top, top_token_ids=columns.top_token_ids[:4 * rows * top],
        top_logprobs=columns.top_logprobs[:4 * rows * top])


def _template_message(message: wire.ChatMessage) -> dict[str, Any]:
    """A chat message in OpenAI's shape: content a string, or its list of parts (images)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.content_parts_json:
        parts = _json_list(message.content_parts_json, "content")
        if not all(isinstance(part, dict) for part in parts or ()):
            raise InvalidPrompt("content parts must be objects")
        rendered["content"] = parts
    if message.name:
        rendered["name"] = message.name
    if message.tool_calls_json:
        rendered["tool_calls"] = _json_list(message.tool_calls_json, "tool_calls")
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _json_list(text: str, what: str) -> list[dict[str, Any]] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidPrompt(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise InvalidPrompt(f"{what} must be a list")
    return value

