"""Cache-aware routing on a real mesh of two engines publishing KV events: a conversation's
later turns land on the engine holding its history (the engine reports the cached tokens),
a restarted gateway replays the events and routes the same, a session sticks to its engine,
and spills to the other past the busy threshold (a second gateway set to spill at once)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.ports import free_port
from tests.faults.streams import poll
from tests.mesh import Mesh, http_get, metric_value, serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
EVENTS = ["--enable-kv-events"]
# One request at a time per engine, so a second one queues; the gateway moves a request
# queued this long to an engine with an empty queue.
ONE_AT_A_TIME = ["--max-num-seqs", "1"]
QUEUE_MOVE_AFTER_S = 2.0
SCHEDULERS = ("scheduler", "scheduler-engine-1")
TOPICS = ["the history of the printing press", "how bread rises",
          "why the sky is blue", "the rules of chess"]


@dataclass
class RouterMesh:
    mesh: Mesh
    spill_url: str    # a second gateway whose sessions spill early (1% of KV in use is busy)


@pytest.fixture(scope="module")
def router_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterMesh]:
    spill_port = free_port()

    def add_engine_and_gateway(mesh: Mesh) -> None:
        mesh.add_engine("engine-1", scheduler_args=EVENTS + ONE_AT_A_TIME,
                        worker_args=ONE_AT_A_TIME)
        mesh.add_service("gateway-spill", ["--port", str(spill_port),
                                           "--router-session-busy-threshold", "0.01"],
                         kind="gateway")

    with serving(Mesh(Path(tmp_path_factory.mktemp("router")), namespace="router",
                      extra_args={"scheduler": EVENTS + ONE_AT_A_TIME,
                                  "worker": ONE_AT_A_TIME,
                                  "gateway": ["--router-queue-move-after-s",
                                              str(QUEUE_MOVE_AFTER_S)]}, worker_threads=1),
                 add_engine_and_gateway) as mesh:
        yield RouterMesh(mesh, f"http://127.0.0.1:{spill_port}")


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def served(mesh: Mesh) -> dict[str, float]:
    """Requests each engine has finished, not counting those moved away (aborted there)."""
    def count(text: str, **labels: str) -> float:
        try:   # a labelled counter shows once it counted one
            return metric_value(text, "vllm:request_success_total", **labels)
        except KeyError:
            return 0.0

    def finished(scheduler: str) -> float:
        text = mesh.services[scheduler].get("/metrics")[1].decode()
        return count(text) - count(text, finished_reason="abort")
    return {s: finished(s) for s in SCHEDULERS}


def served_since(mesh: Mesh, before: dict[str, float], total: int) -> list[float]:
    """Requests each engine finished since `before`, once they add up to `total` or more (an
    engine counts a request as it ends, a moment before its client hears; a longer request
    under way may end meanwhile too)."""
    poll(lambda: sum(served(mesh).values()) - sum(before.values()) >= total, 30,
         f"the engines to count {total} more finished requests")
    now = served(mesh)
    return [now[s] - before[s] for s in SCHEDULERS]


def turn(client: openai.OpenAI, messages: list[dict[str, str]],
         session: str | None = None) -> tuple[str, int, int]:
    """One chat turn: (answer, prompt tokens, cached prompt tokens)."""
    extra = {"prompt_cache_key": session} if session else None
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0, extra_body=extra)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return (reply.choices[0].message.content or "", usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens or 0)


def long_answer(client: openai.OpenAI, session: str, num_tokens: int) -> int:
    """A story of exactly num_tokens in the session; returns the tokens it got."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=num_tokens, temperature=0,
        extra_body={"prompt_cache_key": session, "ignore_eos": True})
    assert reply.usage is not None
    return reply.usage.completion_tokens


def router_caught_up(mesh: Mesh) -> None:
    """Until the gateway's router has applied every KV event batch each scheduler has
    published: it then knows what each engine holds."""
    def total(text: str, name: str) -> float:
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name)

    def caught_up() -> bool:
        published = sum(total(mesh.services[s].get("/metrics")[1].decode(),
                              "llm_mesh:kv_event_batches") for s in SCHEDULERS)
        applied = total(http_get(f"{mesh.base_url}/metrics")[1].decode(),
                        "llm_mesh:router_kv_event_batches_applied")
        return applied >= published
    poll(caught_up, 30, "the router to apply every KV event batch")


def next_turns(client: openai.OpenAI, histories: list[list[dict[str, str]]],
               question: str, mesh: Mesh) -> list[tuple[int, int]]:
    """Adds one user turn to every conversation, one after another, each once the router
    knows where the last one left its blocks: (prompt, cached) tokens of each."""
    figures = []
    for history in histories:
        history.append({"role": "user", "content": question})
        router_caught_up(mesh)
        answer, prompt_tokens, cached = turn(client, history)
        history.append({"role": "assistant", "content": answer})
        figures.append((prompt_tokens, cached))
    return figures


def assert_history_found(previous: list[tuple[int, int]],
                         figures: list[tuple[int, int]]) -> None:
    """Each turn's engine held the previous turn's prompt (its whole blocks)."""
    for (prompt_before, _), (_, cached) in zip(previous, figures, strict=True):
        assert cached >= prompt_before // BLOCK_SIZE * BLOCK_SIZE, (prompt_before, cached)


def test_later_turns_land_where_their_history_is_even_after_a_gateway_restart(
        router_mesh: RouterMesh) -> None:
    mesh = router_mesh.mesh
    client = client_for(mesh.base_url)
    before = served(mesh)
    histories = [[{"role": "user", "content": f"Tell me about {topic}, in detail."}]
                 for topic in TOPICS]
    # The first turns arrive together: the prefills the router sent to one engine count
    # against it, so the conversations spread over both.
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        answers = list(pool.map(lambda history: turn(client, history), histories))
    for history, (answer, _, _) in zip(histories, answers):
        history.append({"role": "assistant", "content": answer})
    assert all(served_since(mesh, before, len(TOPICS))), "one engine took every conversation"
    previous = [(prompt_tokens, cached) for _, prompt_tokens, cached in answers]
    for question in ("Go on.", "And then?"):
        figures = next_turns(client, histories, question, mesh)
        assert_history_found(previous, figures)
        previous = figures

    # A new gateway knows nothing but what it replays from the KV events stream.
    mesh.restart("gateway")
    poll(lambda: http_get(f"{mesh.base_url}/health")[0] == 200, 120, "the gateway to serve")
    mesh.wait_gateway_sees_engines()
    figures = next_turns(client_for(mesh.base_url), histories, "Sum it up.", mesh)
    assert_history_found(previous, figures)
    assert metric_at(mesh.base_url, "llm_mesh:router_decisions_total",
                     reason="kv_overlap") == len(TOPICS)


def test_a_session_sticks_to_its_engine_and_spills_past_the_threshold(
        router_mesh: RouterMesh) -> None:
    mesh, spill_url = router_mesh.mesh, router_mesh.spill_url
    client = client_for(mesh.base_url)
    before = served(mesh)
    for topic in TOPICS:   # unrelated prompts: only the session ties them together
        turn(client, [{"role": "user", "content": f"One line on {topic}."}], session="s-1")
    counts = served_since(mesh, before, len(TOPICS))
    assert sorted(counts) == [0, len(TOPICS)], counts

    # The second gateway calls an engine busy once 1% of its KV is in use: a long answer of
    # the session holds its engine past that while the session's next turn arrives.
    spiller = client_for(spill_url)
    turn(spiller, [{"role": "user", "content": "A first question."}], session="s-2")
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(long_answer, spiller, "s-2", 600)
        poll(lambda: max(metric_samples(spill_url, "vllm:kv_cache_usage_perc")) >= 0.01, 60,
             "the spilling gateway to see the long answer's engine busy")
        holding = [s for s in SCHEDULERS
                   if mesh.scheduler_metric("vllm:num_requests_running", s) == 1]
        spills = metric_at(spill_url, "llm_mesh:router_session_spills_total")
        before = served(mesh)
        turn(spiller, [{"role": "user", "content": "A second question."}], session="s-2")
        served_after = dict(zip(SCHEDULERS, served_since(mesh, before, 1), strict=True))
        assert long.result(timeout=300) == 600
    # The turn went to the engine the long answer does not hold (which may have counted the
    # long answer's end meanwhile).
    assert len(holding) == 1 and any(n for s, n in served_after.items() if s not in holding), (
        holding, served_after)
    assert metric_at(spill_url, "llm_mesh:router_session_spills_total") == spills + 1


def test_a_request_queued_behind_a_busy_engine_moves_to_an_idle_one(
        router_mesh: RouterMesh) -> None:
    mesh = router_mesh.mesh
    client = client_for(mesh.base_url)
    moved = metric_at(mesh.base_url, "llm_mesh:request_migrations_total", outcome="moved")
    # The session holds one engine with a long answer; its next request queues behind it.
    turn(client, [{"role": "user", "content": "Hello."}], session="q")
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(long_answer, client, "q", 400)
        poll(lambda: sum(mesh.scheduler_metric("vllm:num_requests_running", s)
                         for s in SCHEDULERS) == 1, 30, "the long answer to run")
        short = pool.submit(turn, client, [{"role": "user", "content": "A short one."}], "q")
        answer, _, _ = short.result(timeout=120)
        assert answer and not long.done(), "the queued request waited for the long one"
        assert long.result(timeout=300) == 400
    assert metric_at(mesh.base_url, "llm_mesh:request_migrations_total",
                     outcome="moved") == moved + 1


def metric_samples(base_url: str, name: str) -> list[float]:
    """Every sample of a gateway's metric (each engine's, for the engines' gauges)."""
    _, body = http_get(f"{base_url}/metrics")
    return [sample.value for family in text_string_to_metric_families(body.decode())
            for sample in family.samples if sample.name == name] or [0.0]


def metric_at(base_url: str, name: str, **labels: str) -> float:
    """A gateway's metric; 0 for a labelled counter that has not counted yet."""
    _, body = http_get(f"{base_url}/metrics")
    try:
        return metric_value(body.decode(), name, **labels)
    except KeyError:
        return 0.0
