"""Run a batch job over NATS alone, without the HTTP API (see docs/batch.md).

Needs a running mesh with a batch runner (`llm-mesh up` starts one) and only nats-py:

    .venv/bin/python examples/batch_over_nats.py --nats-url nats://127.0.0.1:4222 --count 5

It uploads a JSONL input file to the batch files Object Store, publishes a job on the jobs
stream, watches the batch record in KV until the job ends, and prints the output file.
With --api-key (in a mesh with API keys), the batch runs as that key's tenant and that key
sees it over HTTP (/v1/batches); without one it runs with no tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import secrets
import time

import nats
from nats.js import api

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def input_file(model: str, count: int, max_tokens: int) -> bytes:
    lines = [{"custom_id": f"question-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}}
             for i in range(count)]
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def owner(api_key: str) -> str:
    """The key id the mesh records as a batch's owner (never the key itself)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:12] if api_key else ""


async def main(args: argparse.Namespace) -> None:
    ns = args.namespace
    client = await nats.connect(args.nats_url, inbox_prefix=args.nats_inbox_prefix)
    js = client.jetstream()

    # 1. The input file: an object named by its file id; its description is the OpenAI
    #    FileObject, so the gateway's /v1/files shows it too.
    file_id = f"file-{secrets.token_hex(12)}"
    data = input_file(args.model, args.count, args.max_tokens)
    file_record = {"id": file_id, "object": "file", "bytes": len(data),
                   "created_at": int(time.time()), "filename": "questions.jsonl",
                   "purpose": "batch", "status": "processed", "owner": owner(args.api_key)}
    files = await js.object_store(f"{ns}-batch-files")
    await files.put(file_id, data, meta=api.ObjectMeta(name=file_id,
                                                       description=json.dumps(file_record)))

    # 2. The job: one JSON message on the jobs stream. Nats-Msg-Id makes a retried publish
    #    of the same job a no-op.
    batch_id = f"batch_{secrets.token_hex(12)}"
    job = {"batch_id": batch_id, "input_file_id": file_id, "endpoint": "/v1/chat/completions",
           "completion_window": "24h", "created_at": int(time.time()),
           "owner": owner(args.api_key)}
    await js.publish(f"{ns}.batch.jobs", json.dumps(job).encode(),
                     headers={"Nats-Msg-Id": batch_id})
    print(f"submitted {batch_id} ({args.count} requests)")

    # 3. Progress: the batch record (OpenAI's Batch object) in KV, watched as it changes.
    records = await js.key_value(f"{ns}-batches")
    watcher = await records.watch(batch_id)
    batch: dict = {}
    async for entry in watcher:
        if entry is None:
            continue  # the watch's "no value yet" marker: the runner has not taken the job
        batch = json.loads(entry.value)
        counts = batch["request_counts"]
        print(f"{batch['status']:>12}: {counts['completed']} completed, "
              f"{counts['failed']} failed of {counts['total']}")
        if batch["status"] in TERMINAL:
            break
    await watcher.stop()

    # 4. The results: output and error files are objects in the same store.
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            content = (await files.get(batch[key])).data.decode()
            for line in content.splitlines():
                entry = json.loads(line)
                response = entry["response"] or {}
                body = response.get("body", {})
                answer = body["choices"][0]["message"]["content"] if "choices" in body \
                    else entry["error"] or body.get("error")
                print(f"{entry['custom_id']}: {answer!r}")
    await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--namespace", default="mesh")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--api-key", default="", help="run the batch as this API key")
    parser.add_argument("--nats-inbox-prefix", default="_INBOX",
                        help="where replies come (compose's `batch` user: _INBOX_batch)")
    asyncio.run(main(parser.parse_args()))
