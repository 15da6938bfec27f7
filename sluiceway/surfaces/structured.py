"""Structured output: a request's format fields -> the constraint of its reply.

Each surface maps its own spelling onto an :class:`OutputFormat` with the
translators here (``json_schema_format`` for OpenAI's ``response_format``
and the Responses API's ``text.format``, ``structured_outputs`` for vLLM's
extension of that name) and then makes one call:

- :func:`text_constraint` for a prompt without a conversation (completions,
  tokens in): the format, compiled;
- :func:`constrained_prompt` for a chat-like request: it renders the
  conversation (as :func:`render_conversation` does) and builds the reply's
  constraint from the format and the tools. Tool calls go through a grammar
  over the tool parser's markup (:mod:`sluiceway.surfaces.tool_grammar`)
  when a call is required (``required``, a named function; the grammar
  replaces the forced prompt prefix), when a tool is ``strict``, or when a
  format must share the reply with tool calls. Reasoning stays free text:
  the constraint starts after it (``ReasoningGate``).

Whatever does not compile is the client's error: a 400 naming the field it
came from (``response_format.json_schema.schema``,
``tools[0].function.parameters``) with the grammar engine's message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any

import anyio
from pydantic import Field, StrictBool, StrictStr, model_validator

from sluiceway.engines.grammar import GrammarEngine, embedded_rule
from sluiceway.parsers.reasoning import DIALECTS, UnsupportedGateError, reasoning_gate
from sluiceway.parsers.registry import TextPathOptions, is_harmony
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.errors import InvalidConstraint, InvalidRequest
from sluiceway.surfaces.base import Serving
from sluiceway.surfaces.conversation import (
    Conversation,
    ConversationParams,
    StopOptions,
    ToolChoiceMode,
    ToolSpec,
    render_conversation,
)
from sluiceway.surfaces.harmony_grammar import harmony_grammar
from sluiceway.surfaces.tool_grammar import CallableTool, CallPlan, call_grammar
from sluiceway.surfaces.wire import StrictModel


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` extension field: exactly one of these."""

    json_schema: Annotated[dict[str, Any] | StrictStr | None, Field(alias="json")] = None
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


#: Attribute -> (the field's name on the wire, its kind).
_KINDS: Mapping[str, tuple[str, ConstraintKind]] = {
    "json_schema": ("json", ConstraintKind.JSON_SCHEMA),
    "regex": ("regex", ConstraintKind.REGEX),
    "choice": ("choice", ConstraintKind.CHOICE),
    "grammar": ("grammar", ConstraintKind.GRAMMAR),
    "json_object": ("json_object", ConstraintKind.JSON_OBJECT),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputFormat:
    """A format a request asked its output to match, and the field that asked
    (errors name it)."""

    constraint: Constraint
    param: str


# --- translators ---------------------------------------------------------------


def json_schema_format(schema: Any, *, param: str) -> OutputFormat:
    """A JSON schema, given as an object or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise InvalidConstraint(f"the schema is not JSON: {error}", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidConstraint("a JSON schema must be an object", param=param)
    # Key order is kept: properties are generated in the schema's order.
    text = json.dumps(schema, ensure_ascii=False)
    return OutputFormat(
        constraint=Constraint(kind=ConstraintKind.JSON_SCHEMA, text=text), param=param
    )


def json_object_format(*, param: str) -> OutputFormat:
    """Any JSON object."""
    return OutputFormat(constraint=Constraint(kind=ConstraintKind.JSON_OBJECT), param=param)


def structured_outputs(
    field: StructuredOutputs | None, *, param: str = "structured_outputs"
) -> OutputFormat | None:
    """vLLM's ``structured_outputs`` (its field names), or None."""
    if field is None:
        return None
    for attribute, (name, kind) in _KINDS.items():
        value = getattr(field, attribute)
        if value in (None, False):
            continue
        where = f"{param}.{name}"
        if kind is ConstraintKind.JSON_SCHEMA:
            return json_schema_format(value, param=where)
        if kind is ConstraintKind.JSON_OBJECT:
            return json_object_format(param=where)
        if kind is ConstraintKind.CHOICE:
            return OutputFormat(constraint=Constraint.choice(value), param=where)
        return OutputFormat(constraint=Constraint(kind=kind, text=value), param=where)
    return None  # unreachable: the model validator wants exactly one


def single_format(*formats: OutputFormat | None) -> OutputFormat | None:
    """The one format a request asked for; asking in two fields is a 400."""
    given = [output for output in formats if output is not None]
    if len(given) > 1:
        first, second = given[0].param.split(".")[0], given[1].param.split(".")[0]
        raise InvalidRequest(f"give either {first} or {second}, not both", param=second)
    return given[0] if given else None


# --- constraints -----------------------------------------------------------------


async def text_constraint(serving: Serving, output: OutputFormat | None) -> Constraint | None:
    """The compiled constraint of a prompt without a conversation (no
    reasoning section to wait out), or None."""
    if output is None:
        return None
    await serving.constraints.check(output.constraint, param=output.param)
    return output.constraint


_PARAMS = ConversationParams()


@dataclass(frozen=True, slots=True)
class ConstrainedPrompt:
    """A rendered conversation and the constraint of its reply (None: free)."""

    ids: tuple[int, ...]
    options: TextPathOptions
    constraint: Constraint | None
    #: How many leading ids were an assistant message's own (issue K).
    reused: int | None = None


async def constrained_prompt(
    serving: Serving,
    conversation: Conversation,
    stops: StopOptions,
    output: OutputFormat | None,
    params: ConversationParams = _PARAMS,
) -> ConstrainedPrompt:
    """Render the conversation (in a worker thread) and compile the
    constraint of its reply: the format, the tool calls, or both."""
    by_grammar = calls_by_grammar(serving, conversation, output, params)
    prompt = await anyio.to_thread.run_sync(
        functools.partial(
            render_conversation, serving, conversation, stops, params, tools_by_grammar=by_grammar
        )
    )
    if output is not None:
        await serving.constraints.check(output.constraint, param=output.param)
    chosen = output
    harmony = is_harmony(serving.parsers.reasoning, serving.parsers.tools)
    if harmony and (by_grammar or output is not None):
        chosen = await _harmony_format(serving, conversation, output, params, calls=by_grammar)
    elif by_grammar:
        chosen = await _call_format(serving, conversation, output, params)
    if chosen is None:
        return ConstrainedPrompt(prompt.ids, prompt.options, None, prompt.reused)
    constraint = chosen.constraint if harmony else _after_reasoning(serving, prompt.options, chosen)
    await serving.constraints.check(constraint, param=chosen.param)
    return ConstrainedPrompt(prompt.ids, prompt.options, constraint, prompt.reused)


def _mode(conversation: Conversation) -> ToolChoiceMode:
    choice = conversation.tool_choice
    return ToolChoiceMode.AUTO if choice is None else choice.mode


def calls_by_grammar(
    serving: Serving,
    conversation: Conversation,
    output: OutputFormat | None,
    params: ConversationParams,
) -> bool:
    """Whether the reply's tool calls are constrained by a grammar."""
    mode = _mode(conversation)
    if not conversation.tools or mode is ToolChoiceMode.NONE or serving.parsers.tools is None:
        return False
    strict = [(index, tool.name) for index, tool in enumerate(conversation.tools) if tool.strict]
    if serving.constraints.grammars is None:
        if strict:
            raise InvalidConstraint(
                "this server has no grammar engine for its model's tokenizer, "
                "so a strict tool's arguments cannot be held to its schema",
                param=params.tool_param(*strict[0]),
            )
        return False  # a required call falls back to the forced prompt prefix
    return bool(strict) or output is not None or mode is not ToolChoiceMode.AUTO


async def _call_format(
    serving: Serving,
    conversation: Conversation,
    output: OutputFormat | None,
    params: ConversationParams,
) -> OutputFormat:
    """The grammar of the reply's tool calls (and of its format, if any)."""
    mode = _mode(conversation)
    named = conversation.tool_choice.name if conversation.tool_choice is not None else None
    tools = []
    for index, tool in enumerate(conversation.tools):
        if mode is ToolChoiceMode.NAMED and tool.name != named:
            continue
        where = params.tool_param(index, tool.name)
        tools.append(await _callable(serving, tool, where))
    grammars = serving.constraints.grammars
    assert grammars is not None  # see calls_by_grammar
    content = None
    if output is not None and mode is ToolChoiceMode.AUTO:
        try:
            content = embedded_rule(output.constraint)
        except ValueError as error:
            raise InvalidConstraint(f"{error} (with tools)", param=output.param) from None
    plan = CallPlan(
        tools=tuple(tools),
        required=mode is not ToolChoiceMode.AUTO,
        parallel=conversation.parallel_tool_calls,
        content=content,
    )
    assert serving.parsers.tools is not None
    text = call_grammar(serving.parsers.tools, plan, functools.partial(_markup, serving, grammars))
    constraint = Constraint(kind=ConstraintKind.GRAMMAR, text=text)
    return OutputFormat(constraint=constraint, param=params.tools)


async def _harmony_format(
    serving: Serving,
    conversation: Conversation,
    output: OutputFormat | None,
    params: ConversationParams,
    *,
    calls: bool,
) -> OutputFormat:
    """The grammar of a harmony reply (:mod:`~sluiceway.surfaces.harmony_grammar`):
    the format holds the final answer, and ``calls`` (tool rules that need a
    grammar) hold the calls; reasoning and preambles stay free."""
    grammars = serving.constraints.grammars
    if grammars is None:  # a format was checked by now, so there is an engine
        raise InvalidConstraint("this server has no grammar engine", param=params.tools)
    final = None
    if output is not None:
        try:
            final = embedded_rule(output.constraint)
        except ValueError as error:
            raise InvalidConstraint(
                f"{error} (gpt-oss's final answer)", param=output.param
            ) from None
    mode = _mode(conversation)
    named = conversation.tool_choice.name if conversation.tool_choice is not None else None
    tools = []
    for index, tool in enumerate(conversation.tools if calls else ()):
        if mode is not ToolChoiceMode.NAMED or tool.name == named:
            tools.append(await _callable(serving, tool, params.tool_param(index, tool.name)))
    text = harmony_grammar(
        functools.partial(_markup, serving, grammars),
        final=final,
        tools=tools,
        answer=mode is ToolChoiceMode.AUTO,
    )
    param = output.param if output is not None and not calls else params.tools
    return OutputFormat(constraint=Constraint(kind=ConstraintKind.GRAMMAR, text=text), param=param)


async def _callable(serving: Serving, tool: ToolSpec, param: str) -> CallableTool:
    """The tool as a call may name it: a strict tool's arguments match its
    schema (one that does not compile is a 400); a non-strict tool's do where
    its schema compiles, else any object will do."""
    schema = dict(tool.parameters) if tool.parameters is not None else {"type": "object"}
    checked = json_schema_format(schema, param=param)
    try:
        await serving.constraints.check(checked.constraint, param=param)
    except InvalidConstraint:
        if tool.strict:
            raise
        return CallableTool(name=tool.name)
    return CallableTool(name=tool.name, parameters=schema)


def _markup(serving: Serving, grammars: GrammarEngine, text: str) -> str:
    return grammars.markup(text, serving.tokenizer.single_token(text))


def _after_reasoning(
    serving: Serving, options: TextPathOptions, output: OutputFormat
) -> Constraint:
    """The constraint, starting after the reasoning section the prompt leaves
    the reply in (if any)."""
    if options.reasoning_parser is None:
        return output.constraint
    dialect = DIALECTS[options.reasoning_parser]
    prefix = options.assistant_prefix + options.forced_prefix
    try:
        gate = reasoning_gate(dialect, prefix, serving.tokenizer.single_token)
    except UnsupportedGateError as error:
        raise InvalidRequest(str(error), param=output.param) from None
    return replace(output.constraint, reasoning=gate)
