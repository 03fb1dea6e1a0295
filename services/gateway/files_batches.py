"""/v1/files and /v1/batches: OpenAI's Files and Batches API over the batch plane in
JetStream (services/frontend/batch_jobs/batch_store.py). The gateway stores files, records batches
and queues their jobs; batch runners do the work and keep the records current.

Every file and batch belongs to the API key that created it (its key id is the record's
`owner`): a caller sees only its own, and another tenant's id answers the same 404 as a
missing one, so ids never reveal what other tenants have. A batch's output and error files
belong to the batch's owner.

The batch plane gets its own NATS connection, opened on first use: it is a storage plane
apart from the request path, and a gateway that never sees a batch never touches JetStream.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile

from services.common.jetstream import retry_transient
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.batch_jobs.records import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOWS,
    BatchJob,
    BatchRecord,
    FileRecord,
    new_batch_id,
    new_file_id,
)
from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError, invalid
from services.frontend.openai.http_response import list_page
from services.frontend.tenancy.auth import owner_of
from services.gateway.body import parse_body
from services.gateway.storage_plane import StoragePlane

BatchPlane = StoragePlane[BatchStore]
MAX_FILE_BYTES = 200 * 1024 * 1024   # OpenAI's limit for a batch input file
MULTIPART_OVERHEAD_BYTES = 64 * 1024
WRITE_RETRY_S = 10.0   # how long a batch's creation waits out a JetStream failover
CANCELLABLE = frozenset({"validating", "in_progress"})


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


def files_batches_router(ctx: FrontendContext) -> APIRouter:
    plane: BatchPlane = StoragePlane(ctx.settings, f"{ctx.client.gateway_id}-batch",
                                     BatchStore.open, "batch")
    router = APIRouter()

    # ---- files

    @router.post("/v1/files")
    async def create_file(request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_FILE_BYTES + MULTIPART_OVERHEAD_BYTES:
            raise ApiError(413, f"files are limited to {MAX_FILE_BYTES} bytes")
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise invalid("send the file as the multipart part `file`", param="file")
            if purpose != "batch":
                raise invalid("purpose must be `batch` (the only purpose served)",
                              param="purpose")
            if upload.size is not None and upload.size > MAX_FILE_BYTES:
                raise ApiError(413, f"files are limited to {MAX_FILE_BYTES} bytes")
            record = FileRecord(id=new_file_id(), filename=upload.filename or "input.jsonl",
                                purpose=purpose, owner=owner_of(request))
            saved = await (await plane.store()).put_file(record, upload.file)
        return saved.api_object()

    @router.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None) -> dict[str, Any]:
        owner = owner_of(request)
        files = [f for f in await (await plane.store()).list_files()
                 if f.owner == owner and (purpose is None or f.purpose == purpose)]
        files.sort(key=lambda f: (f.created_at, f.id), reverse=True)
        return list_page([f.api_object() for f in files], has_more=False)

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
        return (await _file(plane, request, file_id)).api_object()

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        await _file(plane, request, file_id)
        data = await (await plane.store()).file_content(file_id)
        if data is None:  # deleted since
            raise _not_found("file", file_id)
        return Response(data, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
        await _file(plane, request, file_id)
        if not await (await plane.store()).delete_file(file_id):
            raise _not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        body = await parse_body(request, CreateBatchRequest, ctx.settings.max_body_bytes)
        if body.endpoint not in BATCH_ENDPOINTS:
            raise invalid(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}",
                          param="endpoint")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise invalid(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                          param="completion_window")
        file = await _file(plane, request, body.input_file_id, param="input_file_id")
        if file.purpose != "batch":
            raise invalid(f"file {file.id} was not uploaded with purpose `batch`",
                          param="input_file_id")
        store = await plane.store()
        job = BatchJob(batch_id=new_batch_id(), input_file_id=file.id, endpoint=body.endpoint,
                       completion_window=body.completion_window, metadata=body.metadata,
                       owner=owner_of(request))
        # Queued first: a record never exists without its job (a runner creates the same
        # record from the job if it gets there first). Both writes are idempotent, so a
        # JetStream stream electing a leader (a node lost or just back) is waited out.
        await retry_transient(lambda: store.submit(job), WRITE_RETRY_S)
        record = await retry_transient(lambda: store.create_record(BatchRecord.from_job(job)),
                                       WRITE_RETRY_S)
        return record.api_object()

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> dict[str, Any]:
        return (await _batch(plane, request, batch_id)).api_object()

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None,
                           limit: int = 20) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise invalid("limit must be between 1 and 100", param="limit")
        owner = owner_of(request)
        records = [r for r in await (await plane.store()).list_records() if r.owner == owner]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        if after is not None:
            ids = [r.id for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        return list_page([r.api_object() for r in records[:limit]],
                     has_more=len(records) > limit)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
        record = await _batch(plane, request, batch_id)
        if record.status in ("cancelling", "cancelled"):
            return record.api_object()
        if record.status not in CANCELLABLE:
            raise invalid(f"a batch with status {record.status} cannot be cancelled")

        def cancel(latest: BatchRecord) -> None:
            if latest.status in CANCELLABLE:
                latest.status = "cancelling"
                latest.cancelling_at = int(time.time())

        return (await (await plane.store()).update_record(batch_id, cancel)).api_object()

    return router


async def _file(plane: BatchPlane, request: Request, file_id: str,
                param: str | None = None) -> FileRecord:
    """The caller's file; 404 for one that is missing or another tenant's alike."""
    record = await (await plane.store()).file_record(file_id)
    if record is None or record.owner != owner_of(request):
        raise _not_found("file", file_id, param)
    return record


async def _batch(plane: BatchPlane, request: Request, batch_id: str) -> BatchRecord:
    """The caller's batch; 404 for one that is missing or another tenant's alike."""
    record = await (await plane.store()).record(batch_id)
    if record is None or record.owner != owner_of(request):
        raise _not_found("batch", batch_id)
    return record


def _not_found(kind: str, object_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No {kind} with id '{object_id}' found.", param=param,
                    code=f"{kind}_not_found")
