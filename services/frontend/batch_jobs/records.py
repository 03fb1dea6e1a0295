"""The batch plane's documents, in the shapes of OpenAI's objects: the job message, the batch
record (OpenAI `Batch`) and the file record (OpenAI `FileObject`).

They are JSON, not protobuf: none of them is on a hot path, HTTP clients and NATS users read
the very same documents, and JSON keeps them readable with the `nats` CLI (`nats kv get`,
`nats pub`). Pydantic types them on both ends.

Each names its owner: the id of the API key that created it (services/frontend/tenancy/auth.py).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]
# A batch id is a KV key and a subject token: no dots, no wildcards.
BATCH_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def output_file_id(batch_id: str) -> str:
    """Fixed per batch, so a runner that finalizes a job twice writes the same file."""
    return f"file-{batch_id}-output"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id}-errors"


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return cls.model_validate_json(data)


class Owned(Document):
    """A tenant's document. `owner` is its API key's id; "" with no key configured (the open
    API) or for a job sent over NATS without one. The stored JSON keeps it; the HTTP API's
    objects leave it out, as OpenAI's do."""
    owner: str = ""

    def api_object(self) -> dict[str, Any]:
        return self.model_dump(exclude={"owner"})


class BatchJob(Owned):
    """The message on the jobs stream: everything a runner needs to create the record."""
    batch_id: str = Field(pattern=BATCH_ID_PATTERN)
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class BatchRecord(Owned):
    """OpenAI's Batch object, as /v1/batches returns it and the KV bucket holds it."""
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    usage: BatchUsage = Field(default_factory=BatchUsage)

    @classmethod
    def from_job(cls, job: BatchJob) -> BatchRecord:
        window_s = COMPLETION_WINDOWS.get(job.completion_window, 0)
        return cls(id=job.batch_id, endpoint=job.endpoint, input_file_id=job.input_file_id,
                   completion_window=job.completion_window, created_at=job.created_at,
                   expires_at=job.created_at + window_s if window_s else None,
                   metadata=job.metadata, owner=job.owner)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def fail(self, code: str, message: str) -> None:
        self.status = "failed"
        self.failed_at = int(time.time())
        self.errors = BatchErrors(data=[BatchError(code=code, message=message)])


class FileRecord(Owned):
    """OpenAI's FileObject; kept as the description of its object in the Object Store."""
    id: str
    object: Literal["file"] = "file"
    bytes: int = 0
    created_at: int = Field(default_factory=lambda: int(time.time()))
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
