"""The whole path, real parts at every hop, driven with the official openai client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from tests.mesh import Mesh, http_get, http_post
from tests.reference import hf_chat_prompt_ids, hf_greedy_ids, hf_model

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 11?",
]
COMPLETION_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1492, Columbus",
    "Once upon a time, in a small village by the mountains, there lived an old",
]


def chat(client: openai.OpenAI, model: str, content: str, **kwargs):  # noqa: ANN201
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kwargs)


def test_greedy_output_equals_hf_generate(client: openai.OpenAI, model_name: str) -> None:
    """10 varied prompts, 32 new tokens each, all in flight at once (one batch)."""
    _, tokenizer = hf_model()

    def ours(prompt: tuple[str, str]) -> str:
        kind, text = prompt
        if kind == "chat":
            return chat(client, model_name, text, temperature=0, max_tokens=32) \
                .choices[0].message.content
        return client.completions.create(model=model_name, prompt=text, temperature=0,
                                         max_tokens=32).choices[0].text

    prompts = [("chat", p) for p in CHAT_PROMPTS] + [("completion", p) for p in COMPLETION_PROMPTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ours, prompts))
    for (kind, text), got in zip(prompts, texts):
        ids = hf_chat_prompt_ids(text) if kind == "chat" else tokenizer(text)["input_ids"]
        expected = tokenizer.decode(hf_greedy_ids(list(ids), 32), skip_special_tokens=True)
        assert got == expected, f"{kind} prompt {text!r}"


def test_streamed_text_equals_non_streamed(client: openai.OpenAI, model_name: str) -> None:
    whole = chat(client, model_name, "Tell me about the moon.", temperature=0, max_tokens=40)
    stream = chat(client, model_name, "Tell me about the moon.", temperature=0, max_tokens=40,
                  stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens

    plain = client.completions.create(model=model_name, prompt="The quick brown fox",
                                      temperature=0, max_tokens=24)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt="The quick brown fox", temperature=0, max_tokens=24,
        stream=True) if c.choices)
    assert streamed == plain.choices[0].text


def test_usage_counts_and_max_tokens_finish_length(mesh: Mesh, client: openai.OpenAI,
                                                   model_name: str) -> None:
    messages = [{"role": "user", "content": "Count from one to fifty in words."}]
    _, counted = http_post(f"{mesh.base_url}/tokenize", {"model": model_name,
                                                          "messages": messages})
    out = client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                         max_tokens=7, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == counted["count"]
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == counted["count"] + 7

    text = client.completions.create(model=model_name, prompt="Hello", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5


def test_stop_string_ends_the_request_everywhere(mesh: Mesh, client: openai.OpenAI,
                                                 model_name: str) -> None:
    prompt = "Once upon a time, in a small village by the mountains, there lived an old"
    full = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                     max_tokens=60, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    words = text.split()
    stop = words[len(words) // 2]
    generated_before = mesh.scheduler_metric("vllm:generation_tokens_total")
    stopped = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                        max_tokens=1500, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    # The engine stopped within a step or two of the match, not at max_tokens.
    wait_for(lambda: mesh.scheduler_metric("vllm:num_requests_running") == 0)
    generated = mesh.scheduler_metric("vllm:generation_tokens_total") - generated_before
    assert generated <= stopped.usage.completion_tokens + 2


def test_sixteen_concurrent_requests_match_their_solo_runs(client: openai.OpenAI,
                                                           model_name: str) -> None:
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]

    def run(prompt: str) -> str:
        return chat(client, model_name, prompt, temperature=0, max_tokens=24) \
            .choices[0].message.content

    solo = [run(p) for p in prompts[:4]]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together[:4] == solo
    assert all(together)


def test_n_choices_and_logprobs(client: openai.OpenAI, model_name: str) -> None:
    out = chat(client, model_name, "Name a color.", temperature=0, max_tokens=8, n=3,
               logprobs=True, top_logprobs=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1   # greedy: identical
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens // 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
    sampled = chat(client, model_name, "Name a color.", temperature=1.0, max_tokens=8, n=2,
                   seed=7)
    again = chat(client, model_name, "Name a color.", temperature=1.0, max_tokens=8, n=2,
                 seed=7)
    assert [c.message.content for c in sampled.choices] == \
        [c.message.content for c in again.choices]


def test_completion_echo_with_logprobs_covers_the_prompt(client: openai.OpenAI,
                                                         model_name: str) -> None:
    prompt_ids = client.completions.create(model=model_name, prompt="Paris is the capital of",
                                           max_tokens=1, temperature=0, echo=True, logprobs=2)
    choice = prompt_ids.choices[0]
    assert choice.text.startswith("Paris is the capital of")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None
    assert len(lp.tokens) == prompt_ids.usage.prompt_tokens + 1
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])


def test_prompt_logprobs_come_back_on_chat_and_completions(client: openai.OpenAI,
                                                           model_name: str) -> None:
    """vLLM's prompt_logprobs: one entry per prompt token (None for the first), each holding
    the prompt token itself and the top ones asked for, on chat (beside the choices, which
    share the prompt) and on completions (per choice)."""
    out = chat(client, model_name, "Name a color.", temperature=0, max_tokens=2,
               extra_body={"prompt_logprobs": 2})
    entries = out.model_extra["prompt_logprobs"]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    prompt_ids = hf_chat_prompt_ids("Name a color.")
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        ranked = sorted((e for e in entry.values() if e["rank"] is not None),
                        key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert all(e["logprob"] <= 0 for e in entry.values())
    completion = client.completions.create(model=model_name, prompt="Paris is the capital of",
                                           max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 1})
    per_choice = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(per_choice) == completion.usage.prompt_tokens and per_choice[0] is None
    assert all(entry and all(e["logprob"] <= 0 for e in entry.values())
               for entry in per_choice[1:])


def test_min_tokens_holds_back_stop_strings(client: openai.OpenAI, model_name: str) -> None:
    """A stop string inside the first min_tokens tokens does not end the request (vLLM)."""
    plain = chat(client, model_name, "Tell me about the sea.", temperature=0, max_tokens=16,
                 extra_body={"ignore_eos": True})
    stop = plain.choices[0].message.content[:3]
    early = chat(client, model_name, "Tell me about the sea.", temperature=0, max_tokens=16,
                 stop=[stop], extra_body={"ignore_eos": True})
    held = chat(client, model_name, "Tell me about the sea.", temperature=0, max_tokens=16,
                stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 8})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < 8
    assert held.usage.completion_tokens >= 8
    assert held.choices[0].message.content.startswith(stop)


def test_a_request_past_its_deadline_ends_with_504_and_frees_its_blocks(
        mesh: Mesh, client: openai.OpenAI, model_name: str) -> None:
    """X-Request-Deadline-S reaches the engine: it ends the request within a step of the
    deadline and frees its blocks; the client gets an OpenAI error with a clear code, streamed
    or not. A bad header is a 400."""
    kwargs = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 1500,
              "extra_body": {"ignore_eos": True}, "extra_headers": {"X-Request-Deadline-S": "1"}}
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ended:
        client.completions.create(**kwargs)
    assert ended.value.status_code == 504 and time.monotonic() - started < 10
    assert ended.value.body["code"] == "deadline_exceeded"
    wait_for(lambda: mesh.scheduler_metric("vllm:num_requests_running") == 0)
    wait_for(lambda: mesh.scheduler_metric("vllm:kv_cache_usage_perc") == 0)
    with pytest.raises(openai.APIError) as streamed:   # the stream's error event
        for _ in client.completions.create(stream=True, **kwargs):
            pass
    assert streamed.value.code == "deadline_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**{**kwargs, "extra_headers": {"X-Request-Deadline-S": "-3"}})
    wait_for(lambda: mesh.scheduler_metric("vllm:kv_cache_usage_perc") == 0)


def test_bad_input_gets_openai_errors_and_never_reaches_the_engine(
        mesh: Mesh, model_name: str) -> None:
    url = f"{mesh.base_url}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    seen_before = mesh.scheduler_metric("vllm:prompt_tokens_total")
    cases = [
        ({"model": model_name, "messages": messages, "temperature": -1}, 400, "temperature"),
        ({"model": model_name, "messages": messages, "n": 0}, 400, "n"),
        ({"model": model_name, "messages": []}, 400, "messages"),
        ({"model": model_name}, 400, "messages"),
        ({"model": "no-such-model", "messages": messages}, 404, "model"),
        ({"model": model_name, "messages": messages, "max_tokens": 100000}, 400, "max_tokens"),
    ]
    for body, status, param in cases:
        code, reply = http_post(url, body)
        assert code == status, (body, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param or param in error["message"]
    code, reply = http_post(url, {"model": model_name, "messages": messages,
                                  "max_tokens": 100000})
    assert reply["error"]["code"] == "context_length_exceeded"
    assert reply["error"]["message"].startswith("This model's maximum context length is 2048 "
                                                "tokens. However, you requested")
    code, reply = http_post(url, b"{not json")
    assert code == 400 and reply["error"]["type"] == "invalid_request_error"
    assert mesh.scheduler_metric("vllm:prompt_tokens_total") == seen_before


def test_client_disconnect_aborts_and_frees_blocks(mesh: Mesh, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Tell me a very long story.", "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{mesh.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                if line.startswith("data:"):
                    chunks += 1
                if chunks >= 3:
                    break
            assert mesh.scheduler_metric("vllm:num_requests_running") >= 1
    wait_for(lambda: mesh.scheduler_metric("vllm:num_requests_running") == 0
             and mesh.scheduler_metric("vllm:kv_cache_usage_perc") == 0)


def test_info_endpoints(mesh: Mesh, model_name: str) -> None:
    assert http_get(f"{mesh.base_url}/health")[0] == 200
    status, body = http_get(f"{mesh.base_url}/version")
    assert status == 200 and b"version" in body
    _, tokens = http_post(f"{mesh.base_url}/tokenize", {"model": model_name, "prompt": "Hi there"})
    _, text = http_post(f"{mesh.base_url}/detokenize", {"model": model_name,
                                                        "tokens": tokens["tokens"]})
    assert text["prompt"] == "Hi there" and tokens["count"] == len(tokens["tokens"])
    for service in mesh.services.values():
        assert service.get("/health")[0] == 200
        assert service.get("/ready")[0] == 200
        assert service.get("/metrics")[0] == 200


def wait_for(condition, timeout_s: float = 15.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
