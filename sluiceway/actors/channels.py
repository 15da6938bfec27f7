"""Channel helpers for the per-token path.

anyio's ``send``/``receive`` always pass a checkpoint first, and looking up the
backend for it is a noticeable share of the event loop's time per streamed
token. Where a message is already waiting (or there is room for one), these
helpers skip that checkpoint; when they do wait, they wait the normal way.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


async def take(receive: MemoryObjectReceiveStream[T]) -> T:
    """Like ``await receive.receive()`` (``EndOfStream`` at the end), without a
    checkpoint when a message is already waiting."""
    try:
        return receive.receive_nowait()
    except anyio.WouldBlock:
        return await receive.receive()


async def put(send: MemoryObjectSendStream[T], message: T) -> None:
    """Like ``await send.send(message)``, without a checkpoint when there is room."""
    try:
        send.send_nowait(message)
    except anyio.WouldBlock:
        await send.send(message)
