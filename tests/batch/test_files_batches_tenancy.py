"""/v1/files and /v1/batches per API key, through the gateway's real app (auth middleware
included) on real JetStream: a key sees, reads, deletes and cancels only its own files and
batches, another key's id answers exactly what a missing one does, and the open API (no key
configured) works as it always did."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx2 as httpx

from tests.batch.conftest import Gateway

CHAT = "/v1/chat/completions"
ALPHA, BETA = "alpha-key", "beta-key"
LINE = b'{"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'

def as_key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def upload(http: httpx.AsyncClient, key: str | None = None) -> dict[str, Any]:
    response = await http.post("/v1/files", files={"file": ("in.jsonl", LINE)},
                               data={"purpose": "batch"}, headers=as_key(key) if key else {})
    assert response.status_code == 200, response.text
    return response.json()


async def create_batch(http: httpx.AsyncClient, file_id: str,
                       key: str | None = None) -> httpx.Response:
    return await http.post("/v1/batches", json={
        "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
        headers=as_key(key) if key else {})


def same_answer(got: httpx.Response, missing: httpx.Response, object_id: str,
                missing_id: str) -> bool:
    """The same status and error object, but for the id the message names."""
    body = got.json()
    body["error"]["message"] = body["error"]["message"].replace(object_id, missing_id)
    return got.status_code == missing.status_code == 404 and body == missing.json()


async def test_a_key_never_sees_another_keys_files_or_batches(gateway: Gateway) -> None:
    http = gateway([ALPHA, BETA])
    alpha_file = await upload(http, ALPHA)
    created = await create_batch(http, alpha_file["id"], ALPHA)
    assert created.status_code == 200, created.text
    alpha_batch = created.json()
    assert "owner" not in alpha_file and "owner" not in alpha_batch   # OpenAI's objects

    f, b = alpha_file["id"], alpha_batch["id"]
    file_calls: list[Callable[[str], Awaitable[httpx.Response]]] = [
        lambda i: http.get(f"/v1/files/{i}", headers=as_key(BETA)),
        lambda i: http.get(f"/v1/files/{i}/content", headers=as_key(BETA)),
        lambda i: http.delete(f"/v1/files/{i}", headers=as_key(BETA)),
        lambda i: create_batch(http, i, BETA),
    ]
    for call in file_calls:
        assert same_answer(await call(f), await call("file-missing"), f, "file-missing")
    batch_calls: list[Callable[[str], Awaitable[httpx.Response]]] = [
        lambda i: http.get(f"/v1/batches/{i}", headers=as_key(BETA)),
        lambda i: http.post(f"/v1/batches/{i}/cancel", headers=as_key(BETA)),
    ]
    for call in batch_calls:
        assert same_answer(await call(b), await call("batch_missing"), b, "batch_missing")
    refused = await create_batch(http, f, BETA)
    assert refused.json()["error"]["param"] == "input_file_id"

    beta_file = await upload(http, BETA)
    for key, own_file in ((ALPHA, f), (BETA, beta_file["id"])):
        files = (await http.get("/v1/files", headers=as_key(key))).json()["data"]
        assert [x["id"] for x in files] == [own_file]
    beta_batches = (await http.get("/v1/batches", headers=as_key(BETA))).json()
    assert beta_batches["data"] == [] and beta_batches["first_id"] is None

    # Beta's attempts changed nothing: alpha's file and batch are whole.
    content = await http.get(f"/v1/files/{f}/content", headers=as_key(ALPHA))
    assert content.status_code == 200 and content.content == LINE
    cancelled = await http.post(f"/v1/batches/{b}/cancel", headers=as_key(ALPHA))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    listed = (await http.get("/v1/batches", headers=as_key(ALPHA))).json()["data"]
    assert [x["id"] for x in listed] == [b]
    deleted = await http.delete(f"/v1/files/{f}", headers=as_key(ALPHA))
    assert deleted.status_code == 200 and deleted.json()["deleted"]


async def test_another_gateway_replica_agrees_on_who_owns_what(gateway: Gateway) -> None:
    alpha_file = await upload(gateway([ALPHA, BETA]), ALPHA)
    replica = gateway([BETA, ALPHA])
    mine = await replica.get(f"/v1/files/{alpha_file['id']}", headers=as_key(ALPHA))
    theirs = await replica.get(f"/v1/files/{alpha_file['id']}", headers=as_key(BETA))
    assert mine.status_code == 200 and theirs.status_code == 404


async def test_the_open_api_sees_its_own_files_and_batches_as_before(gateway: Gateway) -> None:
    keyed, open_api = gateway([ALPHA]), gateway([])
    await upload(keyed, ALPHA)   # a tenant's file stays its own when keys are turned off
    uploaded = await upload(open_api)
    created = await create_batch(open_api, uploaded["id"])
    assert created.status_code == 200, created.text
    batch = created.json()
    assert [x["id"] for x in (await open_api.get("/v1/files")).json()["data"]] == \
        [uploaded["id"]]
    assert (await open_api.get(f"/v1/files/{uploaded['id']}/content")).content == LINE
    assert (await open_api.get(f"/v1/batches/{batch['id']}")).json() == batch
    assert [x["id"] for x in (await open_api.get("/v1/batches")).json()["data"]] == \
        [batch["id"]]
    assert (await open_api.post(f"/v1/batches/{batch['id']}/cancel")).status_code == 200
    assert (await keyed.get("/v1/files", headers=as_key(ALPHA))).json()["data"][0]["id"] != \
        uploaded["id"]
