"""Per-request detokenizer state: incremental decoding, stop strings, token strings."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from services.common import wire, wire_pb
from services.tokenizer.stop_strings import StopChecker
from services.tokenizer.text_codec import TextCodec


class RequestDetokenizer:
    """Turns one request's token deltas into text deltas.

    Decoding is incremental (tokenizers' DecodeStream keeps the byte-level state, so a
    character split across tokens comes out whole once complete) and costs ~1 us a token.
    """

    def __init__(self, request_id: str, params: wire.DetokenizeParams,
                 num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.gateway_id = params.gateway_id
        self.engine_id = params.engine_id
        self.return_token_strings = params.return_token_strings
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_output_tokens = 0     # across moves: what the client has been sent
        self._num_resumed_tokens = 0   # of those, streamed before the request moved here
        self.has_output = False
        self.detokenize_time_s = 0.0
        self.registered_at = time.monotonic()
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = (StopChecker(params.stop, params.include_stop_str_in_output,
                                   params.min_tokens) if params.stop else None)

    def resume(self, codec: TextCodec, token_ids: Sequence[int], num_chars: int) -> None:
        """Continues after output tokens already streamed elsewhere (the request moved to
        another engine or tokenizer): replays them through the decoder without emitting,
        and marks the first `num_chars` characters of their text as delivered, so held-back
        text, a character split across tokens and a half-matched stop string carry on
        exactly where they were."""
        pieces = [self._stream.step(codec.fast, int(t)) or "" for t in token_ids]
        text = "".join(pieces)
        self.num_output_tokens = self._num_resumed_tokens = len(token_ids)
        if self._stops is not None:
            min_end = len("".join(pieces[:self._stops.min_tokens]))
            self._stops.resume(text, num_chars, min_end)

    def stream_position(self, engine_position: int) -> int:
        """Where tokens the engine numbers from `engine_position` (its count starts at this
        submission) fall in the client's stream; past `num_output_tokens` after a lost batch."""
        return self._num_resumed_tokens + engine_position

    def process(self, codec: TextCodec, token_ids: Sequence[int]) -> tuple[str, int, str | None]:
        """Returns (new text, tokens consumed, the stop string matched or None).

        Tokens after the one that completes a stop string are dropped.
        """
        self.has_output = True
        started = time.perf_counter()
        try:
            return self._process(codec, token_ids)
        finally:
            self.detokenize_time_s += time.perf_counter() - started

    def _process(self, codec: TextCodec, token_ids: Sequence[int]) -> tuple[str, int, str | None]:
        pieces: list[str] = []
        for consumed, token_id in enumerate(token_ids, start=1):
            piece = self._stream.step(codec.fast, int(token_id))
            self.num_output_tokens += 1
            if piece is None:
                continue
            if self._stops is None:
                pieces.append(piece)
                continue
            emit, stop = self._stops.append(piece, self.num_output_tokens)
            pieces.append(emit)
            if stop is not None:
                return "".join(pieces), consumed, stop
        return "".join(pieces), len(token_ids), None

    def flush(self) -> str:
        """Text held back for stop-string matching, when the request ends otherwise."""
        return self._stops.flush() if self._stops is not None else ""

    def finish_info(self, reason: wire.FinishReason, stop_reason: str = "",
                    engine_info: wire_pb.FinishInfo | None = None) -> wire_pb.FinishInfo:
        """The request's final record: the engine's (timings, stop token, error) when it
        ended there, with what only the tokenizer knows."""
        info = engine_info if engine_info is not None else wire_pb.FinishInfo(
            num_cached_tokens=self.num_cached_tokens, engine_id=self.engine_id)
        info.request_id = self.request_id
        info.finish_reason = reason
        info.stop_reason = stop_reason
        info.num_prompt_tokens = self.num_prompt_tokens
        info.num_output_tokens = self.num_output_tokens
        info.detokenize_time_s = self.detokenize_time_s
        return info
