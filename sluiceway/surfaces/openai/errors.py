"""Chat and completions answer errors in OpenAI's own body, ``{"error":
{message, type, param, code}}``, rendered by the module the OpenAI-shaped
surfaces share."""

from __future__ import annotations

from sluiceway.surfaces.openai_error_shape import ErrorBody, error_frame, render_error

__all__ = ["ErrorBody", "error_frame", "render_error"]
