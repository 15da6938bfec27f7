"""The Responses API answers errors in OpenAI's ``{"error": {message, type,
param, code}}``, rendered by the module the OpenAI-shaped surfaces share."""

from __future__ import annotations

from sluiceway.surfaces.openai_error_shape import ErrorBody, render_error

__all__ = ["ErrorBody", "render_error"]
