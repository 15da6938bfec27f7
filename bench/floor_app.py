"""The least a streamed token can cost under Hypercorn: a floor for issue J.

An ASGI app with nothing of sluiceway in it. A ticker stands in for the
engine and the scheduler: every step it wakes each open stream once, and
each stream then sends one prebuilt SSE frame of a completions chunk's size
through Hypercorn, as sluiceway's reply task does for a token. So what the
event loop spends per token here is what asyncio and Hypercorn (its ASGI
send path, h11's chunked framing, the socket write) cost on their own, with
no scheduling, detokenizing, parsing or encoding:
``bench/loop_ab.py --floor b`` sets it against the server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _frame(text: str, finish: str | None = None, **extra: object) -> bytes:
    """One SSE frame of a completions chunk, as the server would send it."""
    chunk = {
        "id": "cmpl-0123456789abcdef0123456789abcdef",
        "object": "text_completion",
        "created": 1764300000,
        "model": "sluiceway-default",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        **extra,
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


#: Frames prebuilt, so that the floor holds no JSON encoding.
FRAMES = [_frame(f" word{index}") for index in range(10)]


def _last_frames(tokens: int) -> bytes:
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}
    return _frame("", "length", usage=usage) + b"data: [DONE]\n\n"


class FloorApp:
    """Streams ``max_tokens`` frames per request, one per ticker step."""

    def __init__(self, step_seconds: float) -> None:
        self.step = step_seconds
        self.waiting: list[asyncio.Future[None]] = []
        self.ticker: asyncio.Task[None] | None = None

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(self.step)
            waiting, self.waiting = self.waiting, []
            for future in waiting:
                if not future.done():
                    future.set_result(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http":
            await self.http(scope, receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.ticker = asyncio.get_running_loop().create_task(self.tick())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.ticker is not None:
                    self.ticker.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        tokens = int(json.loads(body).get("max_tokens", 16))
        loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for index in range(tokens):
            future = loop.create_future()
            self.waiting.append(future)
            await future
            frame = FRAMES[index % len(FRAMES)]
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": _last_frames(tokens)})


def serve(port: int, step_seconds: float) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    asyncio.run(hypercorn_serve(FloorApp(step_seconds), config))  # type: ignore[arg-type]
