"""The grammar of a reply's tool calls, written in the active tool parser's markup.

Theory of operation. A tool call is constrained by a Lark grammar (llguidance's
dialect) over the very text the tool-call parser reads, so the parser sees
nothing new: the same envelope, the same tags, arguments that now match their
schema. Per call the grammar spells the dialect's envelope with the tool's
name and its arguments: hermes writes them as one JSON object (the schema
inlined with ``%json``), qwen3_coder as one ``<parameter=KEY>`` block per
property, raw text for string parameters and JSON for the others.

What surrounds the calls depends on the tool choice:

- a call is required (``required``, a named function): the reply is the
  calls, one or, with parallel calls, several;
- ``auto``: free text with calls anywhere in it (none at all is fine) -- or,
  when the request also asked for a format, that format *or* the calls.

Free text never holds the call's opening tag: the parser would take it for a
call, so the grammar must too. Tags that are one added token of the model
(``<tool_call>``) are that token in the grammar (see
:meth:`GrammarEngine.markup`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sluiceway.engines.grammar import lark_json, lark_literal, lark_regex
from sluiceway.parsers.tools import qwen3_coder
from sluiceway.parsers.tools.base import CLOSE_TAG, OPEN_TAG, ToolSchema

#: Text -> its Lark symbol (the tag's token, or a literal).
Markup = Callable[[str], str]

#: Arguments when a tool has no schema to hold them to.
ANY_OBJECT: Mapping[str, Any] = MappingProxyType({"type": "object"})


@dataclass(frozen=True, slots=True, kw_only=True)
class CallableTool:
    """A tool a call may name; ``parameters`` None: any arguments."""

    name: str
    parameters: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CallPlan:
    """What the reply may be, around its tool calls."""

    tools: tuple[CallableTool, ...]
    #: At least one call (``required`` or a named function).
    required: bool
    #: More than one call.
    parallel: bool
    #: The body of a Lark rule the reply may be instead of calls (a format
    #: the request asked for); None: free text, with calls anywhere in it.
    content: str | None = None


CallRules = Callable[[int, CallableTool, Markup], list[str]]


def call_grammar(dialect: str, plan: CallPlan, markup: Markup) -> str:
    """The Lark grammar of a reply under ``plan`` in ``dialect``'s markup."""
    rules = _DIALECTS[dialect]
    lines = [f"start: {_start(plan)}"]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(plan.tools))))
    for index, tool in enumerate(plan.tools):
        lines += rules(index, tool, markup)
    if plan.content is not None:
        lines.append(f"content: {plan.content}")
    elif not plan.required:
        # Any text that does not hold the opening tag (the parser would read a call there).
        never = lark_regex("(?s:.*)" + re.escape(OPEN_TAG) + "(?s:.*)")
        lines.append(f"TEXT: /(?s:.+)/ & ~{never}")
    return "\n".join(lines) + "\n"


def _start(plan: CallPlan) -> str:
    calls = 'call ("\\n"? call)*' if plan.parallel else "call"
    if plan.required:
        return calls
    if plan.content is not None:
        return f"content | {calls}"
    return "TEXT? (call TEXT?)*" if plan.parallel else "TEXT? (call TEXT?)?"


# --- hermes: <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call> ------


def _hermes(index: int, tool: CallableTool, markup: Markup) -> list[str]:
    head = f'\n{{"name": {json.dumps(tool.name)}, "arguments": '
    arguments = lark_json(tool.parameters if tool.parameters is not None else ANY_OBJECT)
    return [
        f"call_{index}: {markup(OPEN_TAG)} {lark_literal(head)} args_{index} "
        f'"}}\\n" {markup(CLOSE_TAG)}',
        f"args_{index}: {arguments}",
    ]


# --- qwen3_coder: <function=f> and a <parameter=KEY> block per argument ------


def _coder(index: int, tool: CallableTool, markup: Markup) -> list[str]:
    head = f"\n{qwen3_coder.FUNCTION_OPEN}{tool.name}>\n"
    tail = f"{qwen3_coder.FUNCTION_CLOSE}\n"
    lines = [
        f"call_{index}: {markup(OPEN_TAG)} {lark_literal(head)} params_{index} "
        f"{lark_literal(tail)} {markup(CLOSE_TAG)}"
    ]
    schema = tool.parameters
    properties = schema.get("properties") if schema is not None else None
    if schema is None or not isinstance(properties, Mapping) or not properties:
        return [*lines, *_any_parameters(index)]
    required = set(schema.get("required") or ())
    sequence = []
    for number, (key, prop) in enumerate(properties.items()):
        name = f"p_{index}_{number}"
        sequence.append(name if key in required else f"{name}?")
        lines += _parameter(name, key, prop, schema, tool)
    lines.append(f"params_{index}: {' '.join(sequence)}")
    return lines


def _any_parameters(index: int) -> list[str]:
    opening = lark_literal(qwen3_coder.PARAMETER_OPEN)
    return [
        f"params_{index}: any_{index}*",
        f'any_{index}: {opening} KEY_{index} ">\\n" value_{index} "\\n"',
        f"KEY_{index}: /[^<>\\r\\n]+/",
        *_text_value(f"value_{index}", {}),
    ]


def _parameter(
    name: str, key: str, prop: Any, schema: Mapping[str, Any], tool: CallableTool
) -> list[str]:
    opening = lark_literal(f"{qwen3_coder.PARAMETER_OPEN}{key}>\n")
    value = f"v_{name}"
    rules = [f'{name}: {opening} {value} "\\n"']
    if qwen3_coder.is_string_parameter(ToolSchema(name=tool.name, parameters=schema), key):
        target = qwen3_coder.resolved(prop, schema)
        return rules + _text_value(value, target if isinstance(target, Mapping) else {})
    # Other values are JSON; $refs resolve against the tool's own definitions.
    definitions = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    embedded = prop if isinstance(prop, Mapping) else {}
    return [*rules, f"{value}: {lark_json({**embedded, **definitions})} {_END}"]


#: Where a value ends: the newline the parser drops, then the closing tag.
_END = lark_literal("\n" + qwen3_coder.PARAMETER_CLOSE)


def _text_value(rule: str, schema: Mapping[str, Any]) -> list[str]:
    """A string parameter's raw text and its end: one of the schema's
    strings, or text of the schema's length that holds no closing tag."""
    options = _literal_options(schema)
    if options is not None:
        return [f"{rule}: ({' | '.join(lark_literal(o) for o in options)}) {_END}"]
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    length = f"{{{low},{'' if high is None else int(high)}}}"
    never = lark_regex("(?s:.*)" + re.escape(qwen3_coder.PARAMETER_CLOSE) + "(?s:.*)")
    terminal = rule.upper()
    return [
        # Lazy: the value ends at the first closing tag, where the parser ends it.
        f"{rule}[lazy]: {terminal} {_END}",
        f"{terminal}: /(?s:.{length})/ & ~{never}",
    ]


def _literal_options(schema: Mapping[str, Any]) -> Sequence[str] | None:
    if "const" in schema and isinstance(schema["const"], str):
        return (schema["const"],)
    options = schema.get("enum")
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return tuple(options)
    return None


_DIALECTS: Mapping[str, CallRules] = MappingProxyType({"hermes": _hermes, "qwen3_coder": _coder})
