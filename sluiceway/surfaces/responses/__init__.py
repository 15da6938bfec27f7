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

from sluiceway.protocol.errors import ApiError
from sluiceway.surfaces.base import ErrorResponse, Headers, SurfaceHandler, bearer_token
from sluiceway.surfaces.responses.create import create, stored
from sluiceway.surfaces.responses.errors import render_error

__all__ = ["ResponsesSurface"]


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

    def render_error(self, error: ApiError) -> ErrorResponse:
        return render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        return bearer_token(headers)
