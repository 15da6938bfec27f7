"""``text.format``: the format a Responses reply's message text is held to.

Only the spelling is the Responses API's: the format becomes the surface-
neutral :class:`~sluiceway.surfaces.structured.OutputFormat`, and the
reply's constraint is built as on chat completions
(:func:`~sluiceway.surfaces.structured.constrained_prompt`): reasoning stays
free text, ``strict`` function tools and a required or named ``tool_choice``
go through a grammar over the tool parser's markup, and a format beside
tools the model may call allows the format *or* calls.
"""

from __future__ import annotations

from typing import Any

from sluiceway.surfaces import structured
from sluiceway.surfaces.responses.wire import ResponsesRequest, TextFormat

PARAM = "text.format"


def _format(request: ResponsesRequest) -> TextFormat | None:
    return request.text.format if request.text is not None else None


def output_format(request: ResponsesRequest) -> structured.OutputFormat | None:
    """The format ``text.format`` asks for (None: free text)."""
    text_format = _format(request)
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return structured.json_object_format(param=PARAM)
    return structured.json_schema_format(text_format.schema_, param=PARAM)


def format_echo(request: ResponsesRequest) -> dict[str, Any]:
    """``text.format`` as the response repeats it."""
    text_format = _format(request)
    if text_format is None:
        return {"type": "text"}
    return text_format.model_dump(by_alias=True, exclude_none=True)
