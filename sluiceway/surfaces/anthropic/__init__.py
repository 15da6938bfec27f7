"""The Anthropic surface: the Messages API (``/v1/messages``,
``/v1/messages/count_tokens``) and, for Anthropic clients, ``/v1/models``.

- wire models: ``wire.py``
- translator (request -> neutral conversation and generation request):
  ``translate.py``, driven by the handlers in ``messages.py``
- encoders (neutral events -> SSE frames with ``event:`` lines, or one
  body): ``encoder.py``, over the block tracker of ``blocks.py``
- the error renderer: ``errors.py``; the API key: ``x-api-key`` or
  ``Authorization: Bearer``
- ``GET /`` (and so ``HEAD /``) answers 200 where nothing else routes ``/``
  (the playground is off): Claude Code probes ``HEAD /`` before its first
  request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import RootModel

from sluiceway.protocol.errors import ApiError
from sluiceway.surfaces.anthropic import messages, models
from sluiceway.surfaces.anthropic.errors import render_error
from sluiceway.surfaces.anthropic.wire import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    ErrorBody,
    MessageDeltaEvent,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageWire,
    PingEvent,
    TokenCount,
)
from sluiceway.surfaces.base import (
    Call,
    ErrorResponse,
    Fallback,
    Headers,
    Operation,
    RouteSpec,
    Serving,
    WhenHeaders,
)

__all__ = ["AnthropicSurface"]


class MessageStreamEvent(
    RootModel[
        MessageStartEvent
        | ContentBlockStartEvent
        | ContentBlockDeltaEvent
        | ContentBlockStopEvent
        | MessageDeltaEvent
        | MessageStopEvent
        | PingEvent
        | ErrorBody
    ]
):
    """Any event of a ``/v1/messages`` stream (for ``/openapi.json``)."""


async def probe(serving: Serving, call: Call) -> None:
    """``GET /`` and ``HEAD /``: the server is there (the router answers
    ``HEAD`` with the ``GET`` handler, and a HEAD reply has no body)."""
    await call.send_json("{}")


@dataclass(frozen=True, slots=True)
class AnthropicSurface:
    """The Anthropic surface object: its routes, errors and credentials."""

    name: str = "anthropic"

    def routes(self) -> Mapping[str, Mapping[str, RouteSpec]]:
        return {
            "/v1/messages": {"POST": messages.handle},
            "/v1/messages/count_tokens": {"POST": messages.count_tokens},
            "/v1/models": {"GET": WhenHeaders(handler=models.models, test=models.speaks_anthropic)},
            "/v1/models/{model}": {
                "GET": WhenHeaders(handler=models.model, test=models.speaks_anthropic)
            },
            "/": {"GET": Fallback(handler=probe, public=True)},
        }

    def operations(self) -> Mapping[str, Mapping[str, Operation]]:
        # /v1/models answers Anthropic's shape only to Anthropic's headers;
        # an OpenAPI path has one operation per method, and there it is OpenAI's.
        return {
            "/v1/messages": {
                "POST": Operation(
                    summary="Create a message",
                    request=MessagesRequest,
                    response=MessageWire,
                    event=MessageStreamEvent,
                    error=ErrorBody,
                )
            },
            "/v1/messages/count_tokens": {
                "POST": Operation(
                    summary="Count a message's input tokens",
                    request=CountTokensRequest,
                    response=TokenCount,
                    error=ErrorBody,
                )
            },
            "/": {"GET": Operation(summary="The server is there (Claude Code probes it)")},
        }

    def render_error(self, error: ApiError) -> ErrorResponse:
        return render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        """``x-api-key``, else ``Authorization: Bearer`` (the SDKs' auth token)."""
        bearer = None
        for name, value in headers:
            if name == b"x-api-key":
                return value.decode("latin-1").strip()
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    bearer = token.strip()
        return bearer
