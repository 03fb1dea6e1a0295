"""One choice of a request, running in the mesh as this gateway tracks it (a Generation), and
the text it streams back (TextDelta). The mesh client registers, places and ends them
(mesh_client.py); a move carries one to another engine or tokenizer (migration.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.common import wire


@dataclass
class TextDelta:
    """One step's output for one request (one choice)."""
    index: int                                   # choice index within its HTTP request
    text: str
    num_new_tokens: int
    finish: wire.FinishInfo | None = None
    logprobs: list[wire.TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)   # the num_new_tokens ids it adds


@dataclass
class Generation:
    """A request (one choice) running in the mesh, as this gateway tracks it."""
    request_id: str
    index: int
    engine_id: str
    scheduler_id: str                           # the scheduler instance holding its state
    tokenizer_id: str
    queue: asyncio.Queue[TextDelta]             # shared by the choices of one HTTP request
    finished: bool = False
    # What a move to another engine or tokenizer needs (migration.py).
    request: wire.GenerateRequest | None = None  # as first submitted: prompt, sampling
    detokenize: wire.DetokenizeParams | None = None
    model: str = ""
    output_token_ids: list[int] = field(default_factory=list)  # streamed so far
    num_chars: int = 0                          # characters of text received so far
    num_moves: int = 0
    moving: bool = False
    queue_moved: bool = False                   # moved once for queueing: never again
    placed_at: float = field(default_factory=time.monotonic)
    last_output_at: float = field(default_factory=time.monotonic)  # or placed, if later
    deadline_at: float | None = None            # monotonic: when the request must have ended
    placed_reconnects: dict[str, int] = field(default_factory=dict)  # instance -> its count


def is_movable(generation: Generation) -> bool:
    """Whether a move can continue it elsewhere: it knows what it was submitted as, and did
    not ask for prompt logprobs (a continuation's prompt differs)."""
    request = generation.request
    return (request is not None and generation.detokenize is not None
            and request.sampling.prompt_logprobs is None)
