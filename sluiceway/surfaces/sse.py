"""Server-sent events framing, shared by every surface's stream encoder.

An encoder builds whole frames (most of a stream's frames come from a
template around the text), so framing is a function it calls rather than a
step the HTTP edge adds; the edge only writes the bytes.
"""

from __future__ import annotations

import json

#: One encoder for every text delta: ``json.dumps(text, ensure_ascii=False)``
#: would build a new encoder object for each streamed token.
_TEXT_ENCODER = json.JSONEncoder(ensure_ascii=False)


def json_string(text: str) -> bytes:
    """``text`` as a JSON string literal, UTF-8 (not escaped to ASCII)."""
    return _TEXT_ENCODER.encode(text).encode("utf-8")


def sse(payload: str, event: str | None = None) -> bytes:
    """One event: an ``event: <type>`` line when the surface names its
    events (Anthropic, Responses), then the ``data:`` line."""
    data = b"data: " + payload.encode("utf-8") + b"\n\n"
    if event is None:
        return data
    return b"event: " + event.encode("utf-8") + b"\n" + data


def comment(text: str) -> bytes:
    """An SSE comment line (clients ignore it; proxies see traffic)."""
    return b": " + text.encode("utf-8") + b"\n\n"
