"""The OpenAI surface: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models``.

- wire models: ``wire.py`` (shared), ``chat_wire.py``, ``completions_wire.py``
- translators (request -> neutral generation request): ``chat.py``,
  ``completions.py``, with ``fields.py`` for the sampling fields both share
- encoders (neutral events -> SSE frames or one body): ``chat_encoder.py``,
  ``completions_encoder.py``, with ``encoding.py`` for the spellings they share
  (``finish_reason``, ``call_`` ids, ``token_id:N``)
- the error renderer: ``errors.py``; the API key: ``Authorization: Bearer``
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from sluiceway.protocol.errors import ApiError
from sluiceway.surfaces.base import ErrorResponse, Headers, Operation, SurfaceHandler
from sluiceway.surfaces.openai import chat, completions, models
from sluiceway.surfaces.openai.chat_wire import ChatChunk, ChatCompletion, ChatRequest
from sluiceway.surfaces.openai.completions_wire import Completion, CompletionRequest
from sluiceway.surfaces.openai.errors import render_error
from sluiceway.surfaces.openai.fields import OpenAIOptions
from sluiceway.surfaces.openai.wire import ErrorBody, ModelCard, ModelList

__all__ = ["OpenAIOptions", "OpenAISurface"]


@dataclass(frozen=True, slots=True)
class OpenAISurface:
    """The OpenAI surface object: its routes, errors and credentials."""

    options: OpenAIOptions = field(default_factory=OpenAIOptions)
    name: str = "openai"

    def routes(self) -> Mapping[str, Mapping[str, SurfaceHandler]]:
        return {
            "/v1/models": {"GET": models.models},
            "/v1/models/{model}": {"GET": models.model},
            "/v1/chat/completions": {"POST": functools.partial(chat.handle, self.options)},
            "/v1/completions": {"POST": functools.partial(completions.handle, self.options)},
        }

    def operations(self) -> Mapping[str, Mapping[str, Operation]]:
        return {
            "/v1/models": {
                "GET": Operation(summary="List models", response=ModelList, error=ErrorBody)
            },
            "/v1/models/{model}": {
                "GET": Operation(summary="Retrieve a model", response=ModelCard, error=ErrorBody)
            },
            "/v1/chat/completions": {
                "POST": Operation(
                    summary="Create a chat completion",
                    request=ChatRequest,
                    response=ChatCompletion,
                    event=ChatChunk,
                    error=ErrorBody,
                )
            },
            "/v1/completions": {
                "POST": Operation(
                    summary="Create a completion",
                    request=CompletionRequest,
                    response=Completion,
                    event=Completion,
                    error=ErrorBody,
                )
            },
        }

    def render_error(self, error: ApiError) -> ErrorResponse:
        return render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return token.strip()
        return None
