"""What every emitter shares: SSE framing, logprob and usage conversion, and
the sans-IO encoder interface. The streaming exchange drives an encoder in
the request's own task (``sluiceway.server.exchange``): framing is a function
call per event, not another task and channel hop."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Protocol

from sluiceway.protocol.messages import EmitterEvent, LogprobEntry, Usage
from sluiceway.protocol.wire import (
    CompletionTokensDetails,
    ErrorBody,
    ErrorDetail,
    PromptTokensDetails,
    TokenLogprobWire,
    TopLogprobWire,
    UsageWire,
)

DONE = b"data: [DONE]\n\n"

#: One encoder for every text delta: ``json.dumps(text, ensure_ascii=False)``
#: would build a new encoder object for each streamed token.
_TEXT_ENCODER = json.JSONEncoder(ensure_ascii=False)


def json_string(text: str) -> bytes:
    """``text`` as a JSON string literal, UTF-8 (not escaped to ASCII)."""
    return _TEXT_ENCODER.encode(text).encode("utf-8")


KEEPALIVE = b": keepalive\n\n"


def sse(payload: str) -> bytes:
    return b"data: " + payload.encode("utf-8") + b"\n\n"


def usage_wire(usage: Usage) -> UsageWire:
    return UsageWire(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )


def entry_wire(entry: LogprobEntry) -> TokenLogprobWire:
    wire = TokenLogprobWire(
        token=entry.token,
        logprob=entry.logprob,
        bytes=list(entry.bytes),
        top_logprobs=[
            TopLogprobWire(token=top.token, logprob=top.logprob, bytes=list(top.bytes))
            for top in entry.top_logprobs
        ],
    )
    if entry.requested:
        wire.token_id_logprobs = {str(t): v for t, v in entry.requested}
    return wire


def entries_wire(entries: Iterable[LogprobEntry]) -> list[TokenLogprobWire]:
    return [entry_wire(entry) for entry in entries]


def prompt_entries_wire(
    entries: Iterable[LogprobEntry | None], top: int
) -> list[TokenLogprobWire | None]:
    """Prompt entries (the first is null), each cut to its ``top`` alternatives."""
    wires: list[TokenLogprobWire | None] = []
    for entry in entries:
        if entry is None:
            wires.append(None)
            continue
        wire = entry_wire(entry)
        wire.top_logprobs = wire.top_logprobs[:top]
        wires.append(wire)
    return wires


def error_frame(message: str) -> bytes:
    body = ErrorBody(error=ErrorDetail(message=message, type="server_error", param=None, code=None))
    return sse(body.to_json())


class StreamEncoder(Protocol):
    """A sans-IO encoder of one request's events into SSE frames."""

    def start(self) -> bytes: ...

    def encode(self, event: EmitterEvent) -> bytes: ...
