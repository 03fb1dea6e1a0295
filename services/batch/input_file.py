"""A batch input file (OpenAI batch JSONL: one {"custom_id", "method", "url", "body"} per
line) into lines to run, and lines that are malformed; and the entries of the output and
error files.

Every line gets a key that depends only on the file's content: a digest of its custom_id, or
its line number when it has no usable custom_id. Results are stored under that key, so a
job run again after a crash finds which lines are done however the lines were scheduled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from services.common.json_depth import MAX_BODY_DEPTH, nesting_depth


@dataclass(frozen=True)
class BatchLine:
    """A well-formed request line."""
    line_number: int    # 1-based, as an editor shows it
    key: str
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class MalformedLine:
    """A line that cannot run: it goes to the error file and the job goes on."""
    line_number: int
    key: str
    custom_id: str | None
    code: str
    message: str


def custom_id_key(custom_id: str) -> str:
    return "c-" + hashlib.sha256(custom_id.encode()).hexdigest()[:32]


def parse_input(data: bytes, endpoint: str) -> list[BatchLine | MalformedLine]:
    """Every non-blank line of the file, in order. A custom_id seen before makes its later
    lines malformed (the first one runs)."""
    lines: list[BatchLine | MalformedLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        line = _parse_line(number, raw, endpoint)
        if line.custom_id is not None:
            if line.custom_id in seen:
                line = MalformedLine(number, f"line-{number}", line.custom_id,
                                     "duplicate_custom_id",
                                     f"custom_id {line.custom_id!r} appears more than once")
            seen.add(line.custom_id)
        lines.append(line)
    return lines


def _parse_line(number: int, raw: bytes, endpoint: str) -> BatchLine | MalformedLine:
    try:
        item = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return MalformedLine(number, f"line-{number}", None, "invalid_json",
                             f"line {number} is not valid JSON: {exc}")
    except RecursionError:   # deeper than the parser itself goes
        return _too_deep(number)
    if nesting_depth(item, stop_past=MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
        return _too_deep(number)   # NOTE: before the body's validation, which recurses
    if not isinstance(item, dict):
        return MalformedLine(number, f"line-{number}", None, "invalid_json",
                             f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return MalformedLine(number, f"line-{number}", None, "missing_custom_id",
                             f"line {number} has no custom_id string")
    key = custom_id_key(custom_id)
    if item.get("method") != "POST":
        return MalformedLine(number, key, custom_id, "invalid_method",
                             f"line {number}: method must be POST")
    if item.get("url") != endpoint:
        return MalformedLine(number, key, custom_id, "mismatched_url",
                             f"line {number}: url must be the batch's endpoint {endpoint}")
    body = item.get("body")
    if not isinstance(body, dict):
        return MalformedLine(number, key, custom_id, "invalid_body",
                             f"line {number}: body must be a JSON object")
    return BatchLine(number, key, custom_id, body)


def _too_deep(number: int) -> MalformedLine:
    return MalformedLine(number, f"line-{number}", None, "invalid_json",
                         f"line {number} nests JSON deeper than {MAX_BODY_DEPTH} levels")


# ---- output and error file entries (OpenAI's batch output format)

def response_entry(key: str, custom_id: str, status_code: int, request_id: str,
                   body: dict[str, Any]) -> bytes:
    """A request that ran: 200 goes to the output file, anything else to the error file."""
    return _entry(key, custom_id, {"status_code": status_code, "request_id": request_id,
                                   "body": body}, None)


def error_entry(line: MalformedLine) -> bytes:
    return _entry(line.key, line.custom_id, None, {"code": line.code, "message": line.message})


def _entry(key: str, custom_id: str | None, response: dict[str, Any] | None,
           error: dict[str, str] | None) -> bytes:
    return json.dumps({"id": f"batch_req_{key}", "custom_id": custom_id, "response": response,
                       "error": error}, separators=(",", ":")).encode()


def is_success(entry: dict[str, Any]) -> bool:
    response = entry.get("response")
    return response is not None and response.get("status_code") == 200
