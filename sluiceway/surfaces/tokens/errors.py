"""The tokens surface answers errors in OpenAI's body, ``{"error": {message,
type, param, code}}``, as vLLM's OpenAI-compatible server does for its tokens
endpoints; the module the OpenAI-shaped surfaces share renders it, before a
reply starts and as a frame inside a stream."""

from __future__ import annotations

from sluiceway.surfaces.openai_error_shape import ErrorBody, error_frame, render_error

__all__ = ["ErrorBody", "error_frame", "render_error"]
