"""The whole tool against an in-process OpenAI-compatible stub (canned SSE, no model)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from llm_mesh.bench.cli import main
from llm_mesh.bench.openai_client import EncodedRequest, OpenAIClient
from services.common.ports import free_port
from tests.bench.stub_server import MODEL, running_stub


def bench(tokenizer: Path, url: str, *extra: str) -> int:
    return main(["serve", "--base-url", url, "--tokenizer", str(tokenizer), "--no-progress",
                 *extra])


def test_sweep_writes_report_json_and_plot(tiny_tokenizer_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    result_json, plot = tmp_path / "out" / "r.json", tmp_path / "out" / "p.png"
    with running_stub(token_delay_s=0.001) as (url, app):
        rc = bench(tiny_tokenizer_dir, url, "--num-prompts", "6", "--input-len", "12",
                   "--output-len", "5", "--ignore-eos", "--sweep", "100,inf", "--warmup", "2",
                   "--goodput", "ttft:10000", "tpot:10000", "--result-json", str(result_json),
                   "--plot", str(plot), "--save-detailed")
    assert rc == 0
    assert len(app.state.bodies) == 2 + 6 + 6
    body = app.state.bodies[-1]
    assert body["model"] == MODEL and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0
    report = json.loads(result_json.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [100.0, "inf"]
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 30 and run["total_input_tokens"] == 72
        assert run["goodput"] == pytest.approx(run["request_throughput"])
        for key in ("ttft", "tpot", "itl", "e2el"):
            d = run[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"]
        assert len(run["requests"]) == 6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Serving Benchmark Result: rate=100" in out and "rate=inf" in out
    assert "TTFT p50/p90/p99 (mean) ms" in out  # the sweep table


def test_failures_are_counted_and_the_run_goes_on(tiny_tokenizer_dir: Path,
                                                  tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    prompts = ["w1 w2", "FAIL_HTTP w3", "w4 FAIL_STREAM", "w5 w6 w7"]
    data.write_text("".join(json.dumps({"prompt": p, "output_len": 4}) + "\n" for p in prompts))
    out = tmp_path / "r.json"
    with running_stub() as (url, _):
        rc = bench(tiny_tokenizer_dir, url, "--workload", "dataset", "--dataset", str(data),
                   "--max-concurrency", "2", "--result-json", str(out))
    run = json.loads(out.read_text())["runs"][0]
    assert rc == 0 and (run["completed"], run["failed"]) == (2, 2)
    assert run["total_output_tokens"] == 8
    assert any("HTTP 500" in e for e in run["errors"]) and "engine died" in run["errors"]


@pytest.mark.parametrize("http_client", ["raw", "httpx2"])
def test_chat_without_usage_counts_chunks(tiny_tokenizer_dir: Path, tmp_path: Path,
                                          http_client: str) -> None:
    out = tmp_path / "r.json"
    with running_stub(send_usage=False) as (url, app):
        rc = bench(tiny_tokenizer_dir, url + "/v1", "--endpoint", "chat", "--num-prompts", "4",
                   "--input-len", "6", "--output-len", "3", "--http-client", http_client,
                   "--sweep", "1,inf", "--sweep-by", "concurrency", "--result-json", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert rc == 0 and [r["label"] for r in runs] == ["rate=inf c=1", "rate=inf"]
    assert all(r["completed"] == 4 and r["total_output_tokens"] == 12 for r in runs)
    assert app.state.bodies[0]["messages"][0]["role"] == "user"


def test_an_unreachable_server_fails_every_request(tiny_tokenizer_dir: Path,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = bench(tiny_tokenizer_dir, f"http://127.0.0.1:{free_port()}", "--model", "m",
               "--num-prompts", "3", "--input-len", "4", "--result-json", str(out))
    run = json.loads(out.read_text())["runs"][0]
    assert rc == 1 and (run["completed"], run["failed"]) == (0, 3)
    assert run["ttft"] is None
    # Without --model the first call (GET /v1/models) fails: one error line, exit 1.
    assert bench(tiny_tokenizer_dir, f"http://127.0.0.1:{free_port()}") == 1
    assert main(["serve", "--tokenizer", str(tmp_path / "missing")]) == 1


def test_a_keep_alive_connection_closed_by_the_server_is_replaced() -> None:
    body = json.dumps({"model": MODEL, "prompt": "w1", "max_tokens": 3, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = EncodedRequest(body, "t", 1)

    async def twice(url: str) -> list[bool]:
        async with OpenAIClient(url, max_connections=1) as client:
            first = await client.send(request)
            await asyncio.sleep(1.5)  # past the server's keep-alive: it closes the socket
            second = await client.send(request)
        return [first.success, second.success]

    with running_stub(keep_alive_s=1) as (url, _):
        assert asyncio.run(twice(url)) == [True, True]


def test_bad_sweep_is_a_usage_error(tiny_tokenizer_dir: Path) -> None:
    with pytest.raises(SystemExit):
        bench(tiny_tokenizer_dir, "http://127.0.0.1:1", "--sweep", "0,inf")
    assert main(["--help"]) == 0 and main(["nope"]) == 2


def test_a_request_dropped_on_a_reused_connection_is_retried_once() -> None:
    """The race a keep-alive pool meets: the server closes a pooled connection just as a
    request goes out on it. Here its first connection drops its second request unanswered."""
    event = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        answered = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            if len(connections) == 1 and answered == 1:
                writer.close()
                return
            writer.write(response)
            answered += 1

    async def run() -> list[bool]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with OpenAIClient(f"http://127.0.0.1:{port}", max_connections=1) as client:
            results = [await client.send(EncodedRequest(b"{}", "t", 1)) for _ in range(3)]
        server.close()
        return [r.success for r in results]

    assert asyncio.run(run()) == [True, True, True]
    assert len(connections) == 2
