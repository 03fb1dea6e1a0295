"""Weight updates without restarts (SGLang's endpoints; admin keys only when API keys are
set): POST /update_weights_from_disk {"model_path", "weight_version"} and
GET /get_weight_version, for every ready engine of the mesh at once or the one named by
?engine_id=. The trainer's side: llm_mesh/trainer.py; docs/rl.md.

Two phases, so every engine takes the new weights or none does: each engine loads them
beside the ones serving (requests go on); if one fails, the others drop theirs and the error
says which; else each commits: it lets the requests under way finish, swaps the weights in
between two steps, empties its prefix cache and serves the requests it held meanwhile on the
new weights. A request's tokens all come from one version.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from services.common import wire
from services.frontend.context import FrontendContext
from services.frontend.errors import invalid
from services.frontend.tenancy.auth import ApiKeys
from services.gateway.body import parse_body
from services.gateway.engine_admin import (
    command_engines,
    engines_to_command,
    raise_failures,
)
from services.gateway.lora_routes import require_admin

# Loading reads the whole checkpoint; a commit first lets the requests under way finish.
_LOAD_TIMEOUT_S = 600.0
_COMMIT_TIMEOUT_S = 600.0
_QUICK_TIMEOUT_S = 30.0


class UpdateWeightsFromDiskRequest(BaseModel):
    model_path: str
    weight_version: str | None = None   # None: a new one, made of the time and a random tail


def weight_router(ctx: FrontendContext, api_keys: ApiKeys) -> APIRouter:
    router = APIRouter()
    max_body_bytes = ctx.settings.max_body_bytes

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request,
                                       engine_id: str | None = None) -> dict[str, Any]:
        require_admin(api_keys, request)
        body = await parse_body(request, UpdateWeightsFromDiskRequest, max_body_bytes)
        if not body.model_path:
            raise invalid("model_path must name a checkpoint directory", param="model_path")
        engines = engines_to_command(ctx, engine_id)
        version = body.weight_version or _new_version()
        serving = await command_engines(ctx, engines, "weight_version", _QUICK_TIMEOUT_S)
        if taken := sorted(e for e, r in serving.items() if r.weight_version == version):
            raise invalid(f"engines {', '.join(taken)} already serve weight_version "
                          f"{version!r}: give each update a version of its own (it names "
                          "the KV blocks its weights compute)", param="weight_version")
        loaded = await command_engines(ctx, engines, "load_weights", _LOAD_TIMEOUT_S,
                                       model_path=body.model_path, weight_version=version)
        if any(not reply.ok for reply in loaded.values()):
            await command_engines(ctx, [e for e, r in loaded.items() if r.ok],
                                  "discard_weights", _QUICK_TIMEOUT_S)
            raise_failures("update_weights", loaded)
        committed = await command_engines(ctx, engines, "commit_weights", _COMMIT_TIMEOUT_S)
        raise_failures("update_weights", committed)
        return {"success": True, "message": "Succeeded to update model weights.",
                "weight_version": version,
                "engines": {e: {"load_seconds": round(loaded[e].seconds, 3),
                                "commit_seconds": round(committed[e].seconds, 3),
                                "requests_finished_first":
                                    committed[e].num_requests_finished_first}
                            for e in engines}}

    @router.get("/get_weight_version")
    async def get_weight_version(request: Request,
                                 engine_id: str | None = None) -> dict[str, Any]:
        """{"weight_version": the version every engine asked serves (null while they
        differ), "engines": each engine's}."""
        require_admin(api_keys, request)
        replies = await command_engines(ctx, engines_to_command(ctx, engine_id),
                                        "weight_version", _QUICK_TIMEOUT_S)
        raise_failures("get_weight_version", replies)
        return _versions(replies)

    return router


def _versions(replies: dict[str, wire.AdminReply]) -> dict[str, Any]:
    versions = {e: r.weight_version for e, r in sorted(replies.items())}
    distinct = set(versions.values())
    return {"weight_version": distinct.pop() if len(distinct) == 1 else None,
            "engines": versions}


def _new_version() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
