"""The grammar of a reply's tool calls, written from the format's description.

Theory of operation. A tool call is constrained by a Lark grammar (llguidance's
dialect) over the very text the tool-call parser reads. Both come from one
description (:mod:`sluiceway.parsers.formats.spec`), part by part, so the
grammar only ever accepts what the parser reads as those calls:

- a literal is that text, after optional whitespace unless it is tight (at
  most :data:`~sluiceway.parsers.formats.spec.MAX_WHITESPACE` characters, so
  that a constrained model cannot stall in it); markup that is one special
  token of the model is that token (see :meth:`GrammarEngine.markup`);
- the function's name is one of the tools' names, and what follows it in the
  call is written for that tool: JSON arguments match its schema (inlined
  with ``%json``); tagged parameters are one block per property, in the
  schema's order, the required ones present, raw text for string parameters
  and JSON for the others; Python keywords likewise, with Python's spelling
  of booleans and null;
- choices, options and repetitions are Lark's; a repetition of calls is cut
  to one when parallel calls are off.

What surrounds the calls depends on the tool choice:

- a call is required (``required``, a named function): the reply is the
  calls, one or, with parallel calls, several;
- ``auto``: free text with calls anywhere in it (none at all is fine) -- or,
  for formats whose calls only open a reply, calls first and then any text;
  or, when the request also asked for a format, that format *or* the calls.

Free text never holds markup that opens a call: the parser would take it for
a call, so the grammar must too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sluiceway.engines.grammar import lark_json, lark_literal, lark_regex
from sluiceway.parsers.formats import FORMATS, GRAPHS
from sluiceway.parsers.formats.arguments import ToolSchema, is_string_parameter, resolved
from sluiceway.parsers.formats.spec import (
    MAX_WHITESPACE,
    Choice,
    Index,
    JsonArguments,
    Lit,
    Name,
    Opt,
    Part,
    PythonArguments,
    Repeat,
    Seq,
    Tagged,
    ToolFormat,
    kinds,
)

#: Text -> its Lark symbol (the tag's token, or a literal).
Markup = Callable[[str], str]

#: Arguments when a tool has no schema to hold them to.
ANY_OBJECT: Mapping[str, Any] = MappingProxyType({"type": "object"})

_WS = "WS?"


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


def call_grammar(format_name: str, plan: CallPlan, markup: Markup) -> str:
    """The Lark grammar of a reply under ``plan`` in the format's markup."""
    fmt = FORMATS[format_name]
    # Whitespace before the markup's first literal is content to the parser
    # (except where markup may only open the reply: there it is held with it).
    writer = _Writer(plan, markup, opening=not fmt.at_start)
    markup_text = writer.write(fmt.body, None)
    sections = _holds_several(fmt.body)
    if sections or not plan.parallel:
        calls = markup_text
    else:
        calls = f"{markup_text} ({_WS} {markup_text})*"
    lines = [f"start: {_start(fmt, plan)}", f"calls: {calls}", *writer.rules]
    lines.append(f"WS: /[ \\t\\r\\n]{{1,{MAX_WHITESPACE}}}/")
    if plan.content is not None:
        lines.append(f"content: {plan.content}")
    elif not plan.required:
        lines.append(f"TEXT: /(?s:.+)/ & ~{_opening(fmt)}")
        if fmt.at_start:
            lines.append("AFTER: /(?s:.+)/")
    return "\n".join(lines) + "\n"


def _start(fmt: ToolFormat, plan: CallPlan) -> str:
    if plan.required:
        return "calls"
    if plan.content is not None:
        return "content | calls"
    if fmt.at_start:
        return "calls AFTER? | TEXT?"
    return "TEXT? (calls TEXT?)*" if plan.parallel else "TEXT? (calls TEXT?)?"


def _opening(fmt: ToolFormat) -> str:
    """Text that the parser would read as the opening of markup."""
    openers = "|".join(re.escape(lit.text) for lit, _ in GRAPHS[fmt.name].entry)
    if fmt.at_start:
        return lark_regex(f"(?s:[ \\t\\r\\n]*(?:{openers}).*)")
    return lark_regex(f"(?s:.*(?:{openers}).*)")


def _holds_several(part: Part) -> bool:
    """Whether the markup itself repeats calls (a section of calls)."""
    if isinstance(part, Repeat):
        return Name in kinds(part.part)
    if isinstance(part, Seq):
        return any(_holds_several(inner) for inner in part.parts)
    if isinstance(part, Choice):
        return any(_holds_several(option) for option in part.options)
    if isinstance(part, Opt):
        return _holds_several(part.part)
    return False


def _takes_no_arguments(tool: CallableTool | None) -> bool:
    """Whether ``{}`` is arguments the tool's schema takes."""
    schema = _schema(tool)
    return not schema.get("required") and not schema.get("minProperties")


def _flat(parts: Sequence[Part]) -> list[Part]:
    out: list[Part] = []
    for part in parts:
        out += _flat(part.parts) if isinstance(part, Seq) else [part]
    return out


class _Writer:
    """Lark expressions for parts, given the tool named so far (None: none yet)."""

    def __init__(self, plan: CallPlan, markup: Markup, *, opening: bool) -> None:
        self._opening = opening
        self._plan = plan
        self._markup = markup
        self.rules: list[str] = []
        self._count = 0

    def write(self, part: Part, tool: CallableTool | None) -> str:
        if isinstance(part, Seq):
            return self._seq(_flat(part.parts), tool)
        if isinstance(part, Lit):
            return self._lit(part)
        if isinstance(part, Choice):
            return "(" + " | ".join(self.write(option, tool) for option in part.options) + ")"
        if isinstance(part, Opt):
            inner = self.write(part.part, tool)
            if JsonArguments in kinds(part.part) and not _takes_no_arguments(tool):
                return inner  # leaving the arguments out means {}
            return f"({inner})?"
        if isinstance(part, Repeat):
            if Name in kinds(part.part) and not self._plan.parallel:
                return ""
            return f"({self.write(part.part, tool)})*"
        if isinstance(part, Index):
            return "/[0-9]{1,6}/"
        if isinstance(part, JsonArguments):
            return f"{_WS} {self.json_rule(_schema(tool))}"
        if isinstance(part, Tagged):
            return _tagged(self, part, tool)
        if isinstance(part, PythonArguments):
            return _python(self, tool)
        if isinstance(part, Name):
            return self._seq([part], tool)
        raise ValueError(f"{part!r} is only written inside its compound part")

    def _seq(self, parts: list[Part], tool: CallableTool | None) -> str:
        out: list[str] = []
        for at, part in enumerate(parts):
            if isinstance(part, Name):
                rest = parts[at + 1 :]
                space = f"{_WS} " if part.ws else ""
                options = [
                    f"{space}{lark_literal(named.name)} {self._seq(rest, named)}"
                    for named in self._plan.tools
                ]
                out.append("(" + " | ".join(options) + ")")
                break
            out.append(self.write(part, tool))
        return " ".join(piece for piece in out if piece)

    def _lit(self, lit: Lit) -> str:
        symbol = self._markup(lit.text)
        tight = lit.tight or self._opening
        self._opening = False
        return symbol if tight else f"{_WS} {symbol}"

    def text(self, text: str) -> str:
        """Fixed text that may hold markup tokens (a literal otherwise)."""
        return self._markup(text) if text else ""

    def json_rule(self, schema: Mapping[str, Any]) -> str:
        return self.rule(lark_json(schema))

    def rule(self, body: str, *, lazy: bool = False) -> str:
        """A new rule with ``body``; its name."""
        self._count += 1
        name = f"r{self._count}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def terminal(self, body: str) -> str:
        self._count += 1
        name = f"T{self._count}"
        self.rules.append(f"{name}: {body}")
        return name


def _schema(tool: CallableTool | None) -> Mapping[str, Any]:
    if tool is None or tool.parameters is None:
        return ANY_OBJECT
    return tool.parameters


def _properties(tool: CallableTool | None) -> tuple[Mapping[str, Any], list[tuple[str, Any]]]:
    schema = _schema(tool)
    properties = schema.get("properties")
    if tool is None or tool.parameters is None or not isinstance(properties, Mapping):
        return schema, []
    return schema, list(properties.items())


def _embedded(prop: Any, schema: Mapping[str, Any]) -> dict[str, Any]:
    """A property's schema with the tool's definitions, so that ``$ref`` resolves."""
    definitions = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return {**(prop if isinstance(prop, Mapping) else {}), **definitions}


# --- tagged parameters ---------------------------------------------------------


def _tagged(writer: _Writer, part: Tagged, tool: CallableTool | None) -> str:
    schema, properties = _properties(tool)
    if not properties:
        return _any_tagged(writer, part)
    required = set(schema.get("required") or ())
    blocks = []
    for key, prop in properties:
        block = _tagged_block(writer, part, writer.text(part.open.text) + " " + lark_literal(key))
        value = _tagged_value(writer, part, tool, key, prop, schema)
        expression = f"{_WS} {block} {value}"
        blocks.append(expression if key in required else f"({expression})?")
    return " ".join(blocks)


def _tagged_block(writer: _Writer, part: Tagged, head: str) -> str:
    """The opening of a parameter up to its value: ``<parameter=KEY>`` and the like."""
    pieces = [head, writer.text(part.close_key.text)]
    if part.value_open is not None:
        opening = writer.text(part.value_open.text)
        pieces.append(opening if part.value_open.tight else f"{_WS} {opening}")
    return " ".join(pieces)


def _any_tagged(writer: _Writer, part: Tagged) -> str:
    key = writer.terminal('/[^<>"\\s=]+/')
    block = _tagged_block(writer, part, f"{writer.text(part.open.text)} {key}")
    value = _text_value(writer, part, {})
    return f"({_WS} {block} {value})*"


def _tagged_value(
    writer: _Writer,
    part: Tagged,
    tool: CallableTool | None,
    key: str,
    prop: Any,
    schema: Mapping[str, Any],
) -> str:
    checked = ToolSchema(name=tool.name if tool else "", parameters=schema)
    if is_string_parameter(checked, key):
        target = resolved(prop, schema)
        return _text_value(writer, part, target if isinstance(target, Mapping) else {})
    return f'"\\n"? {writer.json_rule(_embedded(prop, schema))} {_close(writer, part)}'


def _close(writer: _Writer, part: Tagged) -> str:
    """The end of a value: the newline the parser takes for markup, and the tag."""
    return f'"\\n"? {writer.text(part.close)}'


def _text_value(writer: _Writer, part: Tagged, schema: Mapping[str, Any]) -> str:
    """A string parameter's raw text and its end: one of the schema's strings,
    or text of the schema's length that the parser reads back as that text."""
    pre = '"\\n"?'
    close = _close(writer, part)
    options = _literal_options(schema)
    if options is not None:
        return f"{pre} ({' | '.join(lark_literal(o) for o in options)}) {close}"
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    length = f"{{{low},{'' if high is None else int(high)}}}"
    # The text never holds the closing tag, and neither starts nor ends with
    # a newline (the parser would take it for the markup's).
    never = [f"(?s:.*{re.escape(part.close)}.*)", "(?s:\\n.*)", "(?s:.*\\n)"]
    excluded = " & ".join(f"~{lark_regex(pattern)}" for pattern in never)
    terminal = writer.terminal(f"/(?s:.{length})/ & {excluded}")
    # Lazy: the value ends at the first closing tag, where the parser ends it.
    return writer.rule(f"{pre} {terminal} {close}", lazy=True)


def _literal_options(schema: Mapping[str, Any]) -> Sequence[str] | None:
    if "const" in schema and isinstance(schema["const"], str):
        return (schema["const"],)
    options = schema.get("enum")
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return tuple(options)
    return None


# --- Python keywords -----------------------------------------------------------


def _python(writer: _Writer, tool: CallableTool | None) -> str:
    schema, properties = _properties(tool)
    if not properties:
        pair = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {_any_python(writer)}'
        return f'({pair} ({_WS} "," {_WS} {pair})*)?'
    required = set(schema.get("required") or ())
    # Required keywords first: keyword order is free in Python.
    ordered = sorted(properties, key=lambda item: item[0] not in required)
    pairs = [
        (key in required, f'{lark_literal(key)} "=" {_python_value(writer, prop, schema)}')
        for key, prop in ordered
    ]
    first, *rest = pairs
    out = first[1]
    for needed, pair in rest:
        piece = f'{_WS} "," {_WS} {pair}'
        out += f" {piece}" if needed else f" ({piece})?"
    return out if first[0] else f"({out})?"


def _python_value(writer: _Writer, prop: Any, schema: Mapping[str, Any]) -> str:
    target = resolved(prop, schema)
    declared = target.get("type") if isinstance(target, Mapping) else None
    if declared == "boolean":
        return '("True" | "False")'
    if declared == "null":
        return '"None"'
    options = _literal_options(target) if isinstance(target, Mapping) else None
    if options is not None:
        quoted = [lark_literal(quote) for o in options for quote in (repr(o), json.dumps(o))]
        return "(" + " | ".join(dict.fromkeys(quoted)) + ")"
    if declared == "string" and isinstance(target, Mapping):
        return writer.terminal(_python_string(target))
    if declared in ("integer", "number"):
        # JSON's spelling of numbers is Python's.
        return writer.json_rule(_embedded(prop, schema))
    return _any_python(writer)


#: The escapes a Python string literal may hold here (others, such as a lone
#: ``\\x`` or ``\\N``, do not parse).
_PYTHON_ESCAPE = r"""\\[\\'"nrt]"""


def _python_string(schema: Mapping[str, Any]) -> str:
    """A Python string literal in either quotes, of the schema's length."""
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    count = f"{{{low},{'' if high is None else int(high)}}}"
    return f"/{_quoted(count)}/"


def _quoted(count: str) -> str:
    """A Python string literal in either quotes with ``count`` characters: on
    one line (a raw newline or carriage return ends a line in Python source)
    and with only the escapes that always parse."""
    return "|".join(f"{q}([^{q}\\\\\\n\\r\\x00]|{_PYTHON_ESCAPE}){count}{q}" for q in "\"'")


def _any_python(writer: _Writer) -> str:
    """A Python literal without brackets: a number, a string, a constant."""
    return writer.terminal(f"/-?[0-9]+(\\.[0-9]+)?|{_quoted('*')}|True|False|None/")
