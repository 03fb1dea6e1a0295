"""The multi-turn workload: the conversation builder, the session runner against a recording
fake server (in the test's own event loop), and the whole CLI against the canned stub."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from llm_mesh.bench.benchmark_metrics import compute_metrics
from llm_mesh.bench.cli import main
from llm_mesh.bench.openai_client import OpenAIClient, SamplingOptions, encode_body
from llm_mesh.bench.runner import BenchmarkPoint, RunResult
from llm_mesh.bench.sessions import MultiTurnOptions, build_conversations, run_sessions
from llm_mesh.bench.stream_parser import RequestResult, StreamParser
from llm_mesh.bench.workloads import PromptBuilder, load_tokenizer
from tests.bench.stub_server import running_stub

OPTIONS = MultiTurnOptions(turns_per_session=3, system_prompt_len=30, turn_input_len=6,
                           output_len=4)
encode = partial(encode_body, model="m", endpoint="chat", sampling=SamplingOptions())


@pytest.fixture(scope="module")
def builder(tiny_tokenizer_dir: Path) -> PromptBuilder:
    return PromptBuilder(load_tokenizer(tiny_tokenizer_dir))


def sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_sessions_share_the_system_prompt_and_are_seeded(builder: PromptBuilder) -> None:
    conversations = build_conversations(OPTIONS, builder, 4, seed=7)
    assert len({c.system for c in conversations}) == 1
    assert builder.count(conversations[0].system) == 30
    user_turns = [t for c in conversations for t in c.user_turns]
    assert len(set(user_turns)) == 12 and {builder.count(t) for t in user_turns} == {6}
    assert len({c.session_id for c in conversations}) == 4
    again = build_conversations(OPTIONS, builder, 4, seed=7)
    assert [(c.session_id, c.system, c.user_turns) for c in again] == \
        [(c.session_id, c.system, c.user_turns) for c in conversations]
    other = build_conversations(OPTIONS, builder, 4, seed=8)
    assert other[0].system != conversations[0].system
    assert other[0].session_id != conversations[0].session_id


def test_histories_grow_with_the_servers_answers(builder: PromptBuilder) -> None:
    [conversation] = build_conversations(OPTIONS, builder, 1, seed=0)
    system, (u1, u2, u3) = conversation.system, conversation.user_turns
    first = conversation.next_request()
    assert first.messages == [{"role": "system", "content": system},
                              {"role": "user", "content": u1}]
    assert first.prompt_len == 36 and first.output_len == 4
    assert first.session_id == conversation.session_id
    conversation.add_answer("first answer", 5)
    conversation.add_answer("second answer", 3)
    third = conversation.next_request()
    assert third.messages == [
        {"role": "system", "content": system}, {"role": "user", "content": u1},
        {"role": "assistant", "content": "first answer"}, {"role": "user", "content": u2},
        {"role": "assistant", "content": "second answer"}, {"role": "user", "content": u3}]
    assert third.prompt_len == 30 + 6 + 5 + 6 + 3 + 6


def test_think_times_are_seeded_and_leave_the_texts_alone(builder: PromptBuilder) -> None:
    thinking = replace(OPTIONS, think_time_s=0.5)
    conversations = build_conversations(thinking, builder, 50, seed=7)
    times = [t for c in conversations for t in c.think_times]
    assert all(len(c.think_times) == 2 for c in conversations)  # between 3 turns
    assert len(set(times)) == 100 and min(times) > 0
    assert 0.4 < sum(times) / len(times) < 0.6  # exponential, mean 0.5 (100 draws)
    again = build_conversations(thinking, builder, 50, seed=7)
    assert [c.think_times for c in again] == [c.think_times for c in conversations]
    plain = build_conversations(OPTIONS, builder, 50, seed=7)
    assert [c.user_turns for c in plain] == [c.user_turns for c in conversations]
    assert all(c.think_times == [0.0, 0.0] for c in plain)


def test_session_hints_are_a_body_field_and_a_header(builder: PromptBuilder) -> None:
    [hinted] = build_conversations(OPTIONS, builder, 1, seed=0)
    encoded = encode(hinted.next_request())
    assert json.loads(encoded.body)["prompt_cache_key"] == hinted.session_id
    assert encoded.headers == {"x-session-id": hinted.session_id}
    [bare] = build_conversations(MultiTurnOptions(session_hints=False, system_prompt_len=4,
                                                  turn_input_len=2), builder, 1, seed=0)
    encoded = encode(bare.next_request())
    assert "prompt_cache_key" not in json.loads(encoded.body) and encoded.headers == {}


def test_the_answer_kept_is_the_content_not_the_thinking() -> None:
    stream = (sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
              + sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
              + sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
              + sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
              + sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                              "prompt_tokens_details": {"cached_tokens": 4}}})
              + b"data: [DONE]\n\n")
    kept = StreamParser(RequestResult(), keep_text=True)
    kept.feed(stream, 1.0)
    r = kept.finish(2.0)
    assert r.success and r.text == "Hello" and r.num_chunks == 3 and r.cached_tokens == 4
    plain = StreamParser(RequestResult())
    plain.feed(stream, 1.0)
    assert plain.finish(2.0).text == ""  # other workloads keep no text


class FakeChatServer:
    """Streams a unique answer per request over keep-alive HTTP/1.1 and records each request.
    It reports a perfect prefix cache: a turn's cached tokens are its session's last prompt."""

    def __init__(self, delay_s: float = 0.02) -> None:
        self.delay_s = delay_s
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.answers: list[str] = []
        self.usages: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self._last_prompt: dict[str, int] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in head.split("\r\n")[1:] if line)}
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                writer.write(await self._answer(headers, body))
        except (asyncio.IncompleteReadError, ConnectionError):  # the client hung up
            writer.close()

    async def _answer(self, headers: dict[str, str], body: dict[str, Any]) -> bytes:
        self.requests.append((headers, body))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        answer = f"answer {len(self.answers)}"
        self.answers.append(answer)
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        key = body["prompt_cache_key"]
        usage = {"prompt_tokens": prompt, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": self._last_prompt.get(key, 0)}}
        self._last_prompt[key] = prompt
        self.usages.append(usage)
        events = (sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                  + b"".join(sse({"choices": [{"index": 0, "delta": {"content": word}}]})
                             for word in (answer[:3], answer[3:]))
                  + sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(events), events))


@asynccontextmanager
async def serving(fake: FakeChatServer) -> AsyncIterator[str]:
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def run_against_fake(builder: PromptBuilder, num_sessions: int, max_concurrency: int,
                     http_client: str = "raw", options: MultiTurnOptions = OPTIONS
                     ) -> tuple[FakeChatServer, RunResult]:
    conversations = build_conversations(options, builder, num_sessions, seed=1)
    fake = FakeChatServer()

    async def go() -> RunResult:
        async with (serving(fake) as url,
                    OpenAIClient(url, "chat", http_client=http_client) as client):
            return await run_sessions(client, conversations, encode,
                                      BenchmarkPoint(math.inf, max_concurrency),
                                      show_progress=False)

    return fake, asyncio.run(go())


@pytest.mark.parametrize("http_client", ["raw", "httpx2"])
def test_turns_go_in_order_each_on_the_previous_answer(builder: PromptBuilder,
                                                       http_client: str) -> None:
    fake, run = run_against_fake(builder, num_sessions=4, max_concurrency=2,
                                 http_client=http_client)
    assert len(fake.requests) == 12 and all(r.success for r in run.results)
    assert 1 < fake.max_in_flight <= 2  # sessions overlap, within the cap
    by_session: dict[str, list[int]] = {}
    for i, (headers, body) in enumerate(fake.requests):
        assert headers["x-session-id"] == body["prompt_cache_key"]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        by_session.setdefault(body["prompt_cache_key"], []).append(i)
    assert len(by_session) == 4
    for indices in by_session.values():
        bodies = [fake.requests[i][1] for i in indices]
        assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
        for earlier, later, answered in zip(bodies, bodies[1:], indices, strict=False):
            # Each turn repeats the previous prompt and the answer the server actually sent.
            assert later["messages"][:-2] == earlier["messages"]
            assert later["messages"][-2] == {"role": "assistant",
                                             "content": fake.answers[answered]}
    assert [r.turn for r in run.results] == [1, 2, 3] * 4  # grouped by session, in order


def test_a_session_pauses_its_think_time_between_turns(builder: PromptBuilder) -> None:
    options = replace(OPTIONS, think_time_s=0.1)
    [conversation] = build_conversations(options, builder, 1, seed=1)
    fake, run = run_against_fake(builder, num_sessions=1, max_concurrency=1, options=options)
    assert all(r.success for r in run.results) and len(run.results) == 3
    for earlier, later, pause in zip(run.results, run.results[1:], conversation.think_times,
                                     strict=False):
        # The next turn leaves no sooner than its draw after the previous answer ended.
        assert later.start_time - (earlier.start_time + earlier.latency) >= pause


def test_cached_tokens_add_up_to_the_hit_rate(builder: PromptBuilder) -> None:
    fake, run = run_against_fake(builder, num_sessions=3, max_concurrency=3)
    m = compute_metrics(run)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in fake.usages)
    prompt = sum(u["prompt_tokens"] for u in fake.usages)
    assert cached > 0 and m.total_cached_tokens == cached
    assert m.prefix_cache_hit_rate == pytest.approx(cached / prompt)
    assert m.ttft_first_turn is not None and m.ttft_first_turn.count == 3
    assert m.ttft_later_turns is not None and m.ttft_later_turns.count == 6
    assert m.ttft_p50_by_turn is not None and len(m.ttft_p50_by_turn) == 3


def test_a_failed_turn_ends_its_session(builder: PromptBuilder) -> None:
    conversations = build_conversations(OPTIONS, builder, 2, seed=1)

    class FailsSecondTurns(FakeChatServer):
        async def _answer(self, headers: dict[str, str], body: dict[str, Any]) -> bytes:
            if len(body["messages"]) == 4:
                self.requests.append((headers, body))
                return b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nboom"
            return await super()._answer(headers, body)

    async def go() -> RunResult:
        async with serving(FailsSecondTurns()) as url, OpenAIClient(url, "chat") as client:
            return await run_sessions(client, conversations,
                                      encode,
                                      BenchmarkPoint(math.inf, None), show_progress=False)

    run = asyncio.run(go())
    assert [(r.turn, r.success) for r in run.results] == [(1, True), (2, False)] * 2
    assert "HTTP 500" in run.results[1].error


def test_the_cli_runs_sessions_and_reports_turns(tiny_tokenizer_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    with running_stub() as (url, app):
        rc = main(["serve", "--base-url", url, "--tokenizer", str(tiny_tokenizer_dir),
                   "--no-progress", "--workload", "multi-turn", "--num-sessions", "3",
                   "--turns-per-session", "2", "--system-prompt-len", "20",
                   "--turn-input-len", "5", "--output-len", "3", "--max-concurrency", "2",
                   "--warmup", "1", "--result-json", str(out)])
    assert rc == 0 and len(app.state.bodies) == 1 + 6
    measured = app.state.bodies[1:]
    assert all(b["max_tokens"] == 3 and "prompt_cache_key" in b for b in measured)
    assert len({b["prompt_cache_key"] for b in measured}) == 3
    assert len({b["messages"][0]["content"] for b in measured}) == 1  # one system prompt
    assert sorted(len(b["messages"]) for b in measured) == [2, 2, 2, 4, 4, 4]
    assert all(b["messages"][2] == {"role": "assistant", "content": "t0 t1 t2 "}
               for b in measured if len(b["messages"]) == 4)  # the stub's streamed answer
    report = json.loads(out.read_text())
    [run] = report["runs"]
    assert report["config"]["endpoint"] == "chat" and report["config"]["num_prompts"] == 6
    assert (run["completed"], run["failed"]) == (6, 0)
    assert run["ttft_first_turn"]["count"] == 3 and len(run["ttft_p50_by_turn"]) == 2
    assert run["prefix_cache_hit_rate"] is None  # the stub reports no cached tokens
    printed = capsys.readouterr().out
    assert "P50 TTFT turns 2+ (ms)" in printed and "P50 TTFT by turn (ms)" in printed


@pytest.mark.parametrize("extra", [["--endpoint", "completions"], ["--num-prompts", "5"],
                                   ["--think-time", "-1"]])
def test_the_cli_refuses_what_multi_turn_cannot_do(tiny_tokenizer_dir: Path,
                                                   extra: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--tokenizer", str(tiny_tokenizer_dir), "--workload", "multi-turn",
              *extra])
