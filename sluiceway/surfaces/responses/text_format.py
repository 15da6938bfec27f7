"""``text.format``: the constraint of a Responses reply's message text.

Built from the neutral pieces of constrained decoding
(:mod:`sluiceway.protocol.constraints`, the reasoning gate, the server's
constraint compiler): reasoning stays free text and the constraint starts
after it, as on chat completions. A format together with tools the model may
call is refused for now: holding both needs a grammar over the tool parser's
markup, which the chat surface's structured output brings (branch
h2-structured); once that lands, this module gives way to it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from sluiceway.parsers.reasoning import DIALECTS, UnsupportedGateError, reasoning_gate
from sluiceway.parsers.registry import TextPathOptions
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces.base import Serving
from sluiceway.surfaces.conversation import Conversation, ToolChoiceMode
from sluiceway.surfaces.responses.wire import ResponsesRequest, TextFormat

PARAM = "text.format"


def _format(request: ResponsesRequest) -> TextFormat | None:
    return request.text.format if request.text is not None else None


def format_constraint(request: ResponsesRequest, conversation: Conversation) -> Constraint | None:
    """The constraint ``text.format`` asks for (None: free text)."""
    text_format = _format(request)
    if text_format is None or text_format.type == "text":
        return None
    choice = conversation.tool_choice
    if conversation.tools and (choice is None or choice.mode is not ToolChoiceMode.NONE):
        raise InvalidRequest(
            f"text.format {text_format.type!r} together with tools the model may call is "
            "not supported yet; send tool_choice 'none' or leave the tools out",
            param=PARAM,
        )
    if text_format.type == "json_object":
        return Constraint(kind=ConstraintKind.JSON_OBJECT)
    # Key order is kept: properties are generated in the schema's order.
    schema = json.dumps(text_format.schema_, ensure_ascii=False)
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, text=schema)


async def reply_constraint(
    serving: Serving, constraint: Constraint, options: TextPathOptions
) -> Constraint:
    """``constraint``, starting after the reasoning the prompt leaves the reply
    in, compiled (one that does not compile is a 400 at ``text.format``)."""
    if options.reasoning_parser is not None:
        dialect = DIALECTS[options.reasoning_parser]
        prefix = options.assistant_prefix + options.forced_prefix
        try:
            gate = reasoning_gate(dialect, prefix, serving.tokenizer.single_token)
        except UnsupportedGateError as error:
            raise InvalidRequest(str(error), param=PARAM) from None
        constraint = replace(constraint, reasoning=gate)
    await serving.constraints.check(constraint, param=PARAM)
    return constraint


def format_echo(request: ResponsesRequest) -> dict[str, Any]:
    """``text.format`` as the response repeats it."""
    text_format = _format(request)
    if text_format is None:
        return {"type": "text"}
    return text_format.model_dump(by_alias=True, exclude_none=True)
