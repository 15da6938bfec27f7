"""The OpenAI surface: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, and vLLM's tokenizer routes (``/tokenize``, ``/detokenize``,
``/tokenizer_info``: they read OpenAI chat messages and answer OpenAI errors).

- wire models: ``wire.py`` (shared), ``chat_wire.py``, ``completions_wire.py``
- translators (request -> neutral generation request): ``chat.py``,
  ``completions.py``, with ``fields.py`` for the sampling fields both share
- encoders (neutral events -> SSE frames or one body): ``chat_encoder.py``,
  ``completions_encoder.py``, with ``encoding.py`` for the spellings they share
  (``finish_reason``, ``call_`` ids, ``token_id:N``)
- the tokenizer routes: ``tokenize.py``, ``tokenize_wire.py``
- the error renderer: ``errors.py``; the API key: ``Authorization: Bearer``
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import RootModel

from sluiceway.protocol.errors import ApiError
from sluiceway.surfaces.base import (
    ErrorResponse,
    Headers,
    Operation,
    SurfaceHandler,
    bearer_token,
)
from sluiceway.surfaces.openai import chat, completions, models, tokenize
from sluiceway.surfaces.openai.chat_wire import ChatChunk, ChatCompletion, ChatRequest
from sluiceway.surfaces.openai.completions_wire import Completion, CompletionRequest
from sluiceway.surfaces.openai.errors import ErrorBody, render_error
from sluiceway.surfaces.openai.fields import OpenAIOptions
from sluiceway.surfaces.openai.tokenize_wire import (
    DetokenizeReply,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeReply,
    TokenizerInfo,
)
from sluiceway.surfaces.openai.wire import ModelCard, ModelList


class TokenizeRequest(RootModel[TokenizePromptRequest | TokenizeChatRequest]):
    """``/tokenize``'s body, either form (for ``/openapi.json``)."""


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
            "/tokenize": {"POST": tokenize.tokenize},
            "/detokenize": {"POST": tokenize.detokenize},
            "/tokenizer_info": {"GET": tokenize.tokenizer_info},
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
            "/tokenize": {
                "POST": Operation(
                    summary="Tokenize a prompt or a conversation",
                    request=TokenizeRequest,
                    response=TokenizeReply,
                    error=ErrorBody,
                )
            },
            "/detokenize": {
                "POST": Operation(
                    summary="Detokenize token ids",
                    request=DetokenizeRequest,
                    response=DetokenizeReply,
                    error=ErrorBody,
                )
            },
            "/tokenizer_info": {
                "GET": Operation(
                    summary="The tokenizer's configuration",
                    response=TokenizerInfo,
                    error=ErrorBody,
                )
            },
        }

    def render_error(self, error: ApiError) -> ErrorResponse:
        return render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        return bearer_token(headers)
