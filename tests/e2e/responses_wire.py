"""Checking Responses replies and event streams.

JSON schemas written from OpenAI's published OpenAPI description of the
Responses API (``Response``, the output items, ``ResponseStreamEvent``;
required-but-nullable fields are required here too), the same checks by the
``openai`` SDK's types, and a checker of a whole event stream: framing,
sequence numbers and the order agents depend on, with every item rebuilt
from its deltas and compared with what the stream says it finished with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, get_args

import jsonschema
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
INTEGER = {"type": "integer", "minimum": 0}

TOP_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
    },
}
LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes", "top_logprobs"],
    "properties": {
        **TOP_LOGPROB["properties"],  # type: ignore[dict-item]
        "top_logprobs": {"type": "array", "items": TOP_LOGPROB},
    },
}
OUTPUT_TEXT = {
    "type": "object",
    "required": ["type", "text", "annotations"],
    "properties": {
        "type": {"const": "output_text"},
        "text": {"type": "string"},
        "annotations": {"type": "array"},
        "logprobs": {"type": "array", "items": LOGPROB},
    },
}
MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "status", "content"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "status": STATUS,
        "content": {"type": "array", "items": OUTPUT_TEXT},
    },
}
REASONING = {
    "type": "object",
    "required": ["id", "type", "summary"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "reasoning"},
        "summary": {"type": "array"},
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "reasoning_text"}, "text": {"type": "string"}},
            },
        },
        "encrypted_content": {"type": ["string", "null"]},
        "status": STATUS,
    },
}
FUNCTION_CALL = {
    "type": "object",
    "required": ["type", "call_id", "name", "arguments"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function_call"},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "arguments": {"type": "string"},
        "status": STATUS,
    },
}
CUSTOM_TOOL_CALL = {
    "type": "object",
    "required": ["type", "call_id", "name", "input"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "custom_tool_call"},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "input": {"type": "string"},
    },
}
OUTPUT_ITEM = {"oneOf": [MESSAGE, REASONING, FUNCTION_CALL, CUSTOM_TOOL_CALL]}
USAGE = {
    "type": "object",
    "required": [
        "input_tokens",
        "input_tokens_details",
        "output_tokens",
        "output_tokens_details",
        "total_tokens",
    ],
    "properties": {
        "input_tokens": INTEGER,
        "input_tokens_details": {
            "type": "object",
            "required": ["cached_tokens", "cache_write_tokens"],
            "properties": {"cached_tokens": INTEGER, "cache_write_tokens": INTEGER},
        },
        "output_tokens": INTEGER,
        "output_tokens_details": {
            "type": "object",
            "required": ["reasoning_tokens"],
            "properties": {"reasoning_tokens": INTEGER},
        },
        "total_tokens": INTEGER,
    },
}
RESPONSE = {
    "type": "object",
    "required": [
        "id",
        "object",
        "created_at",
        "error",
        "incomplete_details",
        "instructions",
        "model",
        "tools",
        "output",
        "parallel_tool_calls",
        "metadata",
        "tool_choice",
        "temperature",
        "top_p",
    ],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "number"},
        "status": {
            "enum": ["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
        },
        "error": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                },
            ]
        },
        "incomplete_details": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {
                        "reason": {"enum": ["max_output_tokens", "content_filter"]},
                    },
                },
            ]
        },
        "instructions": {"type": ["string", "array", "null"]},
        "model": {"type": "string"},
        "tools": {
            "type": "array",
            "items": {"type": "object", "required": ["type"]},
        },
        "output": {"type": "array", "items": OUTPUT_ITEM},
        "parallel_tool_calls": {"type": "boolean"},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "tool_choice": {"type": ["string", "object"]},
        "temperature": {"type": ["number", "null"]},
        "top_p": {"type": ["number", "null"]},
        "max_output_tokens": {"type": ["integer", "null"]},
        "previous_response_id": {"type": ["string", "null"]},
        "usage": {"oneOf": [{"type": "null"}, USAGE]},
        "store": {"type": "boolean"},
    },
}


def _event(type_: str, **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", "sequence_number", *properties],
        "properties": {"type": {"const": type_}, "sequence_number": INTEGER, **properties},
    }


_ITEM_REF = {"item_id": {"type": "string"}, "output_index": INTEGER}
_PART_REF = {**_ITEM_REF, "content_index": INTEGER}
_LOGPROBS = {"type": "array", "items": LOGPROB}

EVENTS = {
    **{
        name: _event(name, response=RESPONSE)
        for name in (
            "response.created",
            "response.in_progress",
            "response.completed",
            "response.incomplete",
            "response.failed",
        )
    },
    "response.output_item.added": _event(
        "response.output_item.added", output_index=INTEGER, item=OUTPUT_ITEM
    ),
    "response.output_item.done": _event(
        "response.output_item.done", output_index=INTEGER, item=OUTPUT_ITEM
    ),
    "response.content_part.added": _event(
        "response.content_part.added", **_PART_REF, part=OUTPUT_TEXT
    ),
    "response.content_part.done": _event(
        "response.content_part.done", **_PART_REF, part=OUTPUT_TEXT
    ),
    "response.output_text.delta": _event(
        "response.output_text.delta", **_PART_REF, delta={"type": "string"}, logprobs=_LOGPROBS
    ),
    "response.output_text.done": _event(
        "response.output_text.done", **_PART_REF, text={"type": "string"}, logprobs=_LOGPROBS
    ),
    "response.reasoning_text.delta": _event(
        "response.reasoning_text.delta", **_PART_REF, delta={"type": "string"}
    ),
    "response.reasoning_text.done": _event(
        "response.reasoning_text.done", **_PART_REF, text={"type": "string"}
    ),
    "response.function_call_arguments.delta": _event(
        "response.function_call_arguments.delta", **_ITEM_REF, delta={"type": "string"}
    ),
    "response.function_call_arguments.done": _event(
        "response.function_call_arguments.done", **_ITEM_REF, arguments={"type": "string"}
    ),
    "response.custom_tool_call_input.delta": _event(
        "response.custom_tool_call_input.delta", **_ITEM_REF, delta={"type": "string"}
    ),
    "response.custom_tool_call_input.done": _event(
        "response.custom_tool_call_input.done", **_ITEM_REF, input={"type": "string"}
    ),
}

_VALIDATORS = {name: jsonschema.Draft202012Validator(schema) for name, schema in EVENTS.items()}
_RESPONSE_VALIDATOR = jsonschema.Draft202012Validator(RESPONSE)


def _sdk_events() -> dict[str, type[BaseModel]]:
    """The SDK's class of each event type (validating against the class is
    much faster than against the whole union)."""
    union = get_args(ResponseStreamEvent)[0]
    return {get_args(cls.model_fields["type"].annotation)[0]: cls for cls in get_args(union)}


_SDK_EVENTS = _sdk_events()


def check_response(body: dict[str, Any]) -> Response:
    """A whole reply, by the schema and by the SDK's type."""
    _RESPONSE_VALIDATOR.validate(body)
    return Response.model_validate(body)


def check_event(event: dict[str, Any]) -> None:
    assert event["type"] in EVENTS, f"an event of unknown type: {event['type']}"
    _VALIDATORS[event["type"]].validate(event)
    _SDK_EVENTS[event["type"]].model_validate(event)


def parse_sse(text: str) -> list[dict[str, Any]]:
    """The events of a stream; each must have an ``event:`` line equal to
    its type (comment lines, such as keepalives, are skipped)."""
    events = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2, f"an event is an event: line and a data: line: {block!r}"
        name, data = lines
        assert name.startswith("event: "), block
        assert data.startswith("data: "), block
        event = json.loads(data[6:])
        assert event["type"] == name[7:], block
        events.append(event)
    return events


@dataclass
class _Open:
    """The item being streamed, rebuilt from its events."""

    item: dict[str, Any]
    index: int
    text: str = ""
    logprobs: list[Any] = field(default_factory=list)
    part_open: bool = False
    text_done: bool = False


_FINAL = ("response.completed", "response.incomplete", "response.failed")
_DELTA_OF = {
    "message": "response.output_text.delta",
    "reasoning": "response.reasoning_text.delta",
    "function_call": "response.function_call_arguments.delta",
    "custom_tool_call": "response.custom_tool_call_input.delta",
}
_DONE_OF = {
    "message": "response.output_text.done",
    "reasoning": "response.reasoning_text.done",
    "function_call": "response.function_call_arguments.done",
    "custom_tool_call": "response.custom_tool_call_input.done",
}
_DONE_FIELD = {
    "response.output_text.done": "text",
    "response.reasoning_text.done": "text",
    "response.function_call_arguments.done": "arguments",
    "response.custom_tool_call_input.done": "input",
}


def without_ids(value: Any) -> Any:
    """A reply or its items without the ids that differ between two replies."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def item_text(item: dict[str, Any]) -> str:
    """What an item's deltas add up to."""
    if item["type"] in ("message", "reasoning"):
        return "".join(part["text"] for part in item.get("content") or [])
    return str(item["arguments"] if item["type"] == "function_call" else item["input"])


class _StreamChecker:
    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.ids: set[str] = set()

    def event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "response.output_item.added":
            self._added(event)
        elif kind == "response.output_item.done":
            self._done(event)
        else:
            self._inner(event)

    def _added(self, event: dict[str, Any]) -> None:
        assert self.open is None, "an item was added while another was open"
        item = event["item"]
        assert event["output_index"] == len(self.done)
        assert item["status"] == "in_progress"
        assert item_text(item) == "", "an added item announces no text yet"
        assert item["id"] not in self.ids
        self.ids.add(item["id"])
        self.open = _Open(item, event["output_index"])

    def _inner(self, event: dict[str, Any]) -> None:
        kind, current = event["type"], self.open
        assert current is not None, f"{kind} outside an item"
        assert event["item_id"] == current.item["id"]
        assert event["output_index"] == current.index
        item_type = current.item["type"]
        if item_type == "message" and kind.startswith("response.content_part."):
            assert event["content_index"] == 0
            self._part(current, event)
            return
        assert not current.text_done, f"{kind} after the item's text was done"
        assert item_type != "message" or current.part_open, f"{kind} outside its content part"
        if "content_index" in event:
            assert event["content_index"] == 0
        if kind == _DELTA_OF[item_type]:
            current.text += event["delta"]
            current.logprobs += event.get("logprobs") or []
            return
        assert kind == _DONE_OF[item_type], f"{kind} inside a {item_type} item"
        assert event[_DONE_FIELD[kind]] == current.text
        if item_type == "message":
            assert event["logprobs"] == current.logprobs
        current.text_done = True

    def _part(self, current: _Open, event: dict[str, Any]) -> None:
        if event["type"] == "response.content_part.added":
            assert not current.part_open
            assert not current.text_done
            assert event["part"]["text"] == ""
            current.part_open = True
            return
        assert current.part_open
        assert current.text_done, "content_part.done before output_text.done"
        assert event["part"]["text"] == current.text
        assert event["part"]["logprobs"] == current.logprobs
        current.part_open = False

    def _done(self, event: dict[str, Any]) -> None:
        current = self.open
        assert current is not None, "output_item.done outside an item"
        item = event["item"]
        assert event["output_index"] == current.index
        assert item["id"] == current.item["id"]
        assert item["type"] == current.item["type"]
        assert current.text_done, "an item ended before its text"
        assert not current.part_open
        assert item["status"] in ("completed", "incomplete")
        assert item_text(item) == current.text
        if item["type"] == "message":
            assert item["content"][0]["logprobs"] == current.logprobs
        self.done.append(item)
        self.open = None


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Check a whole stream; returns the response its last event carries."""
    for number, event in enumerate(events):
        check_event(event)
        assert event["sequence_number"] == number
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in _FINAL, kinds
    assert not any(kind in _FINAL for kind in kinds[:-1]), kinds
    for event in events[:2]:
        assert event["response"]["status"] == "in_progress"
        assert event["response"]["output"] == []
    checker = _StreamChecker()
    for event in events[2:-1]:
        assert event["type"] not in ("response.created", "response.in_progress"), event
        checker.event(event)
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"]
    if final["status"] != "failed":
        assert checker.open is None, "the response ended inside an item"
        assert final["output"] == checker.done
    assert final["status"] == events[-1]["type"].removeprefix("response.")
    check_response(final)
    return dict(final)
