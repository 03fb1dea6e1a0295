"""A response's output items, built from the chat output as it arrives, and the events that
stream them (OpenAI's order: an item is added, its content grows by deltas, then it is done).

Chat deltas carry text (`content`), a reasoning model's thinking (`reasoning_content`) and
tool calls (`tool_calls`, each first with its id and name, then argument pieces). Text and
thinking open a message or reasoning item that the next kind of output closes; each tool
call is a `function_call` item of its own. The same builder serves a whole response (one
delta with the finished message) and a stream, so the two cannot disagree.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]   # a streamed event without its sequence_number (the stream numbers it)


@dataclass
class _OpenText:
    """The message or reasoning item whose text is streaming."""
    index: int
    kind: str          # "message" | "reasoning"
    text: str = ""


@dataclass
class ResponseOutput:
    items: list[dict[str, Any]] = field(default_factory=list)
    # Output index -> item id, for a run resumed in another gateway: its items keep the ids
    # its first gateway already streamed.
    known_ids: dict[int, str] = field(default_factory=dict)
    _open: _OpenText | None = None
    _calls: dict[int, int] = field(default_factory=dict)   # chat tool-call index -> item index

    def add(self, delta: dict[str, Any]) -> list[Event]:
        """The events for one chat delta (role-only and empty deltas give none)."""
        events: list[Event] = []
        if thinking := delta.get("reasoning_content"):
            events += self._text("reasoning", thinking)
        if content := delta.get("content"):
            events += self._text("message", content)
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Closes every open item; `incomplete`: the output was cut at max_output_tokens."""
        events = self._close_text(incomplete)
        for index in self._calls.values():
            item = self.items[index]
            item["status"] = "incomplete" if incomplete else "completed"
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"],
                           "arguments": item["arguments"]})
            events.append({"type": "response.output_item.done", "output_index": index,
                           "item": dict(item)})
        self._calls.clear()
        return events

    def messages(self) -> list[dict[str, Any]]:
        """The output as the chat messages a later turn replays (previous_response_id)."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message] if text or calls else []

    def _new_id(self, index: int, prefix: str) -> str:
        return self.known_ids.get(index) or f"{prefix}_{secrets.token_hex(12)}"

    # ---- text and thinking

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close_text(incomplete=False)
            events += self._open_text(kind)
        assert self._open is not None
        self._open.text += text
        item = self.items[self._open.index]
        delta_type = ("response.output_text.delta" if kind == "message"
                      else "response.reasoning_text.delta")
        events.append({"type": delta_type, "item_id": item["id"],
                       "output_index": self._open.index, "content_index": 0, "delta": text,
                       **({"logprobs": []} if kind == "message" else {})})
        return events

    def _open_text(self, kind: str) -> list[Event]:
        index = len(self.items)
        if kind == "message":
            item = {"id": self._new_id(index, "msg"), "type": "message",
                    "status": "in_progress", "role": "assistant", "content": []}
        else:
            item = {"id": self._new_id(index, "rs"), "type": "reasoning", "summary": [],
                    "content": [], "status": "in_progress"}
        self.items.append(item)
        self._open = _OpenText(index, kind)
        events: list[Event] = [{"type": "response.output_item.added", "output_index": index,
                                "item": _copy(item)}]
        if kind == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": index, "content_index": 0,
                           "part": _text_part("message", "")})
        return events

    def _close_text(self, incomplete: bool) -> list[Event]:
        if self._open is None:
            return []
        index, kind, text = self._open.index, self._open.kind, self._open.text
        self._open = None
        item = self.items[index]
        part = _text_part(kind, text)
        item["content"] = [part]
        item["status"] = "incomplete" if incomplete else "completed"
        if kind == "message":
            events: list[Event] = [
                {"type": "response.output_text.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "part": dict(part)}]
        else:
            events = [{"type": "response.reasoning_text.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "text": text}]
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": _copy(item)})
        return events

    # ---- tool calls

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        index = self._calls.get(call.get("index", 0))
        if index is None:
            events += self._close_text(incomplete=False)
            index = len(self.items)
            self._calls[call.get("index", 0)] = index
            self.items.append({"id": self._new_id(index, "fc"), "type": "function_call",
                               "status": "in_progress", "call_id": call.get("id") or "",
                               "name": function.get("name") or "", "arguments": ""})
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": dict(self.items[index])})
        item = self.items[index]
        if arguments := function.get("arguments"):
            item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": index, "delta": arguments})
        return events


def _text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item.get("content", [])]}
