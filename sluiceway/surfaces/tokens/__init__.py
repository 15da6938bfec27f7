"""The tokens surface: ``POST /inference/v1/generate``, token ids in and out
(vLLM's tokens endpoint, plus streaming).

- wire models: ``wire.py``; translator: ``generate.py``; encoders (SSE
  frames and the whole reply): ``encoder.py``; errors (OpenAI's body):
  ``errors.py``; the API key: ``Authorization: Bearer``
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sluiceway.protocol.errors import ApiError
from sluiceway.surfaces.base import (
    ErrorResponse,
    Headers,
    Operation,
    SurfaceHandler,
    bearer_token,
)
from sluiceway.surfaces.tokens import generate
from sluiceway.surfaces.tokens.errors import ErrorBody, render_error
from sluiceway.surfaces.tokens.wire import (
    GenerateChunk,
    GenerateReply,
    GenerateRequest,
)

__all__ = ["TokensSurface"]


@dataclass(frozen=True, slots=True)
class TokensSurface:
    """The tokens surface object: its route, errors and credentials."""

    name: str = "tokens"

    def routes(self) -> Mapping[str, Mapping[str, SurfaceHandler]]:
        return {"/inference/v1/generate": {"POST": generate.handle}}

    def operations(self) -> Mapping[str, Mapping[str, Operation]]:
        return {
            "/inference/v1/generate": {
                "POST": Operation(
                    summary="Generate from token ids",
                    request=GenerateRequest,
                    response=GenerateReply,
                    event=GenerateChunk,
                    error=ErrorBody,
                )
            }
        }

    def render_error(self, error: ApiError) -> ErrorResponse:
        return render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        return bearer_token(headers)
