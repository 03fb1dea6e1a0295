"""The `multi-turn` workload: agent-like chat sessions, for measuring cache-aware routing.

Every session opens with the same system prompt (an agent's tools and instructions), then
sends its turns one after another: turn k's messages are the system prompt, all earlier
user/assistant turns — the assistant turns being the text the server actually answered —
and a new user message. Outputs are short, so the cost of a turn is mostly its prefill, and
what decides it is whether the engine serving the turn still holds the history's KV blocks.

Between turns an agent runs its tools or a person reads: `think_time_s` (the mean of an
exponential draw, 0 by default) is that pause. It matters to routing: without it a session's
next turn arrives the instant its engine frees a slot, so even a least-loaded router sends it
back to the same engine.

Each request names its session twice, as OpenAI's `prompt_cache_key` body field and as an
`x-session-id` header, so a router can keep the conversation on one engine. Sessions arrive
like the other workloads' requests (rate, burstiness) and each holds a concurrency slot for
its whole life: `--max-concurrency` is the number of agents running at once.

The seed fixes the system prompt, every user turn, the session ids and the arrival times;
the assistant turns are whatever the server answers.
"""

from __future__ import annotations

import asyncio

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from llm_mesh.bench.openai_client import EncodedRequest, OpenAIClient
from llm_mesh.bench.runner import BenchmarkPoint, RunResult, progress_bar, run_jobs
from llm_mesh.bench.stream_parser import RequestResult
from llm_mesh.bench.workloads import PromptBuilder, SampleRequest

TAG = "multi-turn"


@dataclass(frozen=True)
class MultiTurnOptions:
    turns_per_session: int = 6
    system_prompt_len: int = 1024   # tokens, shared by every session
    turn_input_len: int = 64        # tokens of new user text per turn
    output_len: int = 32
    session_hints: bool = True      # send prompt_cache_key and x-session-id
    think_time_s: float = 0.0       # mean pause between a turn's answer and the next turn


@dataclass
class Conversation:
    """One session's chat; `history` grows by a user and an assistant message per turn."""

    session_id: str
    system: str
    user_turns: list[str]           # drawn up front, so the seed fixes them all
    options: MultiTurnOptions
    think_times: list[float]        # seconds before turns 2, 3, ...; drawn up front too
    history: list[dict[str, str]] = field(default_factory=list)
    # A local count of the history's content tokens (no chat template) for prompt_len, which
    # the server's usage replaces: counting here would re-tokenize the history every turn.
    context_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.context_tokens = self.options.system_prompt_len

    @property
    def turns_done(self) -> int:
        return len(self.history) // 2

    def next_request(self) -> SampleRequest:
        """The next turn: the system prompt, the history so far, and the next user text."""
        messages = [{"role": "system", "content": self.system}, *self.history,
                    {"role": "user", "content": self.user_turns[self.turns_done]}]
        o = self.options
        return SampleRequest(None, messages, self.context_tokens + o.turn_input_len,
                             o.output_len, TAG, self.session_id if o.session_hints else None)

    def add_answer(self, text: str, num_tokens: int) -> None:
        """Closes the current turn with the server's answer, which later turns then carry."""
        self.history += [{"role": "user", "content": self.user_turns[self.turns_done]},
                         {"role": "assistant", "content": text}]
        self.context_tokens += self.options.turn_input_len + num_tokens


def build_conversations(options: MultiTurnOptions, builder: PromptBuilder, num_sessions: int,
                        seed: int) -> list[Conversation]:
    """`num_sessions` fresh conversations sharing one system prompt; seeded."""
    rng = np.random.default_rng(seed)
    # A stream of its own, so that adding think time leaves a seed's texts unchanged.
    pauses = np.random.default_rng([seed, 1])
    system = builder.text(rng, options.system_prompt_len)
    return [Conversation(f"bench-{seed}-{i}", system,
                         [builder.text(rng, options.turn_input_len)
                          for _ in range(options.turns_per_session)], options,
                         _think_times(pauses, options))
            for i in range(num_sessions)]


def _think_times(rng: np.random.Generator, options: MultiTurnOptions) -> list[float]:
    gaps = options.turns_per_session - 1
    if options.think_time_s <= 0:
        return [0.0] * gaps
    return [float(t) for t in rng.exponential(options.think_time_s, gaps)]


async def run_sessions(client: OpenAIClient, conversations: Sequence[Conversation],
                       encode: Callable[[SampleRequest], EncodedRequest],
                       point: BenchmarkPoint, burstiness: float = 1.0, seed: int = 0,
                       show_progress: bool = True) -> RunResult:
    """Runs every session to its end (or its first failed turn: with no answer there is no
    history to go on with); the results carry their 1-based turn."""
    total = sum(len(c.user_turns) for c in conversations)
    with progress_bar(total, point, show_progress) as progress:
        async def session(conversation: Conversation) -> list[RequestResult]:
            results = []
            for turn in range(1, len(conversation.user_turns) + 1):
                result = await client.send(encode(conversation.next_request()), keep_text=True)
                result.turn = turn
                results.append(result)
                progress.update(1)
                if not result.success:
                    break
                conversation.add_answer(result.text, result.output_tokens)
                if turn < len(conversation.user_turns):
                    await asyncio.sleep(conversation.think_times[turn - 1])  # the agent's tools
            return results

        return await run_jobs([partial(session, c) for c in conversations], point, burstiness,
                              seed)
