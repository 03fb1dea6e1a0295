"""Logprob columns from the mesh -> the OpenAI completions and chat logprobs shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.common import wire
from services.common.packing import unpack_float32, unpack_int32, unpack_strings

_FLOOR = -9999.0  # JSON has no -inf; vLLM sends this instead


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


@dataclass
class LogprobRow:
    token: str
    logprob: float
    top: list[tuple[str, float]]
    token_id: int = 0
    top_ids: list[int] = field(default_factory=list)


def rows(entry: wire.TokenLogprobs) -> list[LogprobRow]:
    columns = entry.columns
    logprobs = unpack_float32(columns.logprobs).tolist()
    num_top = columns.num_top
    top_logprobs = unpack_float32(columns.top_logprobs).tolist()
    token_ids = unpack_int32(columns.token_ids).tolist()
    top_token_ids = unpack_int32(columns.top_token_ids).tolist()
    tokens = unpack_strings(entry.token_strings)
    top_tokens = unpack_strings(entry.top_token_strings)
    out = []
    for r, (token, logprob) in enumerate(zip(tokens, logprobs)):
        top = [(top_tokens[r * num_top + k], _finite(top_logprobs[r * num_top + k]))
               for k in range(num_top)]
        out.append(LogprobRow(token, _finite(logprob), top, token_ids[r],
                              top_token_ids[r * num_top:(r + 1) * num_top]))
    return out


@dataclass
class CompletionLogprobs:
    """`choices[].logprobs` of /v1/completions: parallel lists, one entry per token."""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    _offset: int = 0

    def add_first_prompt_token(self, token: str) -> None:
        """The first prompt token has no logprob (nothing precedes it)."""
        self._append(token, None, None)

    def add(self, row: LogprobRow) -> None:
        top = {token: logprob for token, logprob in row.top}
        top.setdefault(row.token, row.logprob)
        self._append(row.token, row.logprob, top)

    def _append(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self._offset)
        self._offset += len(token)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}

    def take(self) -> dict[str, Any]:
        """The entries added since the last take (a streamed chunk's logprobs)."""
        chunk = self.to_json()
        offset = self._offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self._offset = offset
        return chunk


def chat_logprob_entries(entry_rows: list[LogprobRow]) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries of /v1/chat/completions."""
    return [{"token": row.token, "logprob": row.logprob, "bytes": list(row.token.encode()),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                              for t, lp in row.top]}
            for row in entry_rows]


def prompt_logprobs_json(prompt_rows: list[LogprobRow]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: one entry per prompt token, None for the first (nothing
    precedes it), then {token id: {"logprob", "rank", "decoded_token"}} for the prompt token
    and the top ones asked for (rank: its place among the top ones, None outside them)."""
    entries: list[dict[str, Any] | None] = [None]
    for row in prompt_rows:
        entry = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": token}
                 for rank, (token_id, (token, logprob))
                 in enumerate(zip(row.top_ids, row.top), start=1)}
        entry.setdefault(str(row.token_id), {"logprob": row.logprob, "rank": None,
                                             "decoded_token": row.token})
        entries.append(entry)
    return entries


def split_logprobs(entries: list[wire.TokenLogprobs]
                   ) -> tuple[list[LogprobRow], list[LogprobRow]]:
    """(prompt rows, output rows) of one delta's logprob entries."""
    prompt: list[LogprobRow] = []
    output: list[LogprobRow] = []
    for entry in entries:
        (prompt if entry.is_prompt else output).extend(rows(entry))
    return prompt, output
