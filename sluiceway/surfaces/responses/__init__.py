"""The OpenAI Responses surface: ``POST /v1/responses`` (stateless).

- wire models: ``wire.py`` (the request), ``reply_wire.py`` (the reply and
  its streamed events)
- translator: ``translate.py`` (items onto the neutral conversation),
  ``tools.py`` (function, custom, namespace and hosted tools), ``create.py``
  (the handler)
- encoders: ``items.py`` (deltas -> output items, sans-IO), ``encoder.py``
  (the event stream and the whole reply)
- structured output: ``text_format.py`` (``text.format`` -> a constraint)
- the error renderer: ``errors.py`` (OpenAI's body); the API key:
  ``Authorization: Bearer``
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import RootModel

from sluiceway.protocol.errors import ApiError
from sluiceway.surfaces.base import (
    ErrorResponse,
    Headers,
    Operation,
    SurfaceHandler,
    bearer_token,
)
from sluiceway.surfaces.responses.create import create, stored
from sluiceway.surfaces.responses.errors import ErrorBody, render_error
from sluiceway.surfaces.responses.reply_wire import (
    ArgumentsDoneEvent,
    CallDeltaEvent,
    CustomInputDoneEvent,
    LifecycleEvent,
    OutputItemEvent,
    PartEvent,
    ResponseWire,
    TextDeltaEvent,
    TextDoneEvent,
)
from sluiceway.surfaces.responses.wire import ResponsesRequest

__all__ = ["ResponsesSurface"]


class ResponseStreamEvent(
    RootModel[
        LifecycleEvent
        | OutputItemEvent
        | PartEvent
        | TextDeltaEvent
        | TextDoneEvent
        | CallDeltaEvent
        | ArgumentsDoneEvent
        | CustomInputDoneEvent
    ]
):
    """Any event of a ``/v1/responses`` stream (for ``/openapi.json``)."""


#: Nothing is stored: these routes answer 404 in the surface's error shape.
_STORED = "(stateless: always 404)"


@dataclass(frozen=True, slots=True)
class ResponsesSurface:
    name: str = "responses"

    def routes(self) -> Mapping[str, Mapping[str, SurfaceHandler]]:
        return {
            "/v1/responses": {"POST": create},
            "/v1/responses/{response_id}": {"GET": stored, "DELETE": stored},
            "/v1/responses/{response_id}/input_items": {"GET": stored},
            "/v1/responses/{response_id}/cancel": {"POST": stored},
        }

    def operations(self) -> Mapping[str, Mapping[str, Operation]]:
        def missing(summary: str) -> Operation:
            return Operation(summary=f"{summary} {_STORED}", error=ErrorBody)

        return {
            "/v1/responses": {
                "POST": Operation(
                    summary="Create a response",
                    request=ResponsesRequest,
                    response=ResponseWire,
                    event=ResponseStreamEvent,
                    error=ErrorBody,
                )
            },
            "/v1/responses/{response_id}": {
                "GET": missing("Retrieve a response"),
                "DELETE": missing("Delete a response"),
            },
            "/v1/responses/{response_id}/input_items": {"GET": missing("List input items")},
            "/v1/responses/{response_id}/cancel": {"POST": missing("Cancel a response")},
        }

    def render_error(self, error: ApiError) -> ErrorResponse:
        return render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        return bearer_token(headers)
