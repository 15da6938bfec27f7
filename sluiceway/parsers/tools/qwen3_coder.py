"""The Qwen3-Coder tool-call dialect (XML-ish parameters):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The arguments JSON is synthesised while the call streams: ``{"city": "Paris",
"days": 3}``. A parameter whose schema type is ``string`` (or unknown) becomes
a JSON string, escaped piece by piece as its value arrives. Any other type is
held until ``</parameter>`` (such values are short: numbers, booleans, small
objects) so that the arguments are always valid JSON: a value that parses as
JSON is passed on as written; an empty one becomes ``null``; Python's
``True``/``False``/``None`` become ``true``/``false``/``null``; anything else
(``three``, ``NaN``, a broken object) becomes a JSON string of its text. One
newline right after ``<parameter=KEY>`` and one right before ``</parameter>``
are markup. Value characters are owned by the tokens that wrote them;
synthetic punctuation by the token whose input called for it.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from types import MappingProxyType

from sluiceway.parsers.events import Channel, Event, dropped
from sluiceway.parsers.markers import MarkerFound, MarkerScanner, MarkerSet
from sluiceway.parsers.tools.base import (
    CLOSE_TAG,
    OPEN_TAG,
    Grammar,
    ToolCallParser,
    ToolSchema,
    name_run,
)

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"


class CoderPhase(enum.Enum):
    TEXT = "text"
    FUNCTION_OPEN = "function_open"  # <tool_call> seen; expecting <function=
    FUNCTION_NAME = "function_name"  # up to ">" (commits)
    BETWEEN = "between"  # <parameter= or </function>
    PARAMETER_KEY = "parameter_key"  # up to ">"
    VALUE_START = "value_start"  # one newline of markup
    VALUE = "value"  # up to (newline and) </parameter>
    CLOSE_TAG = "close_tag"  # </tool_call>
    TRAILING = "trailing"


_P = CoderPhase

GRAMMAR: Grammar[CoderPhase] = Grammar(
    text=_P.TEXT,
    envelope=_P.FUNCTION_OPEN,
    literals=MappingProxyType(
        {
            _P.FUNCTION_OPEN: ((FUNCTION_OPEN, _P.FUNCTION_NAME),),
            _P.BETWEEN: ((PARAMETER_OPEN, _P.PARAMETER_KEY), (FUNCTION_CLOSE, _P.CLOSE_TAG)),
            _P.CLOSE_TAG: ((CLOSE_TAG, _P.TRAILING),),
        }
    ),
    committed=frozenset({_P.BETWEEN, _P.PARAMETER_KEY, _P.VALUE_START, _P.VALUE, _P.CLOSE_TAG}),
    transitions=MappingProxyType(
        {
            _P.TEXT: frozenset({_P.FUNCTION_OPEN}),
            _P.FUNCTION_OPEN: frozenset({_P.FUNCTION_NAME, _P.TEXT}),
            _P.FUNCTION_NAME: frozenset({_P.BETWEEN, _P.TEXT}),
            _P.BETWEEN: frozenset({_P.PARAMETER_KEY, _P.CLOSE_TAG, _P.TEXT}),
            _P.PARAMETER_KEY: frozenset({_P.VALUE_START, _P.TEXT}),
            _P.VALUE_START: frozenset({_P.VALUE}),
            _P.VALUE: frozenset({_P.BETWEEN}),
            _P.CLOSE_TAG: frozenset({_P.TRAILING, _P.TEXT}),
            _P.TRAILING: frozenset({_P.TEXT}),
        }
    ),
)

_NAME_CHARS = re.compile(r'[^"\\<>\s\x00-\x1f]+')
_KEY_CHARS = re.compile(r"[^<>\r\n]+")
_VALUE_END = MarkerSet(("\n" + PARAMETER_CLOSE, PARAMETER_CLOSE))


_PYTHON_LITERALS = MappingProxyType({"True": "true", "False": "false", "None": "null"})


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def is_json(text: str) -> bool:
    """Whether ``text`` is one strict JSON value (no ``NaN`` or ``Infinity``)."""
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return False
    return True


def json_escape(text: str) -> str:
    """``text`` as it appears between the quotes of a JSON string (escaping is per character)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def is_string_parameter(tool: ToolSchema | None, key: str) -> bool:
    """Whether the tool's schema types ``key`` as a string (the default when unknown)."""
    if tool is None:
        return True
    properties = tool.parameters.get("properties")
    schema = properties.get(key) if isinstance(properties, Mapping) else None
    return _is_string_schema(schema, tool.parameters)


def _is_string_schema(schema: object, root: Mapping[str, object], depth: int = 0) -> bool:
    """A declared type decides; so do values that are all strings or not
    (``enum``, ``const``) and alternatives that all take strings or not
    (``anyOf``, ``oneOf``). A non-string value is read as JSON, which still
    turns text that is not JSON into a string, so only a schema that takes
    strings alone (or says nothing) is read as text."""
    schema = resolved(schema, root)
    if not isinstance(schema, Mapping):
        return True
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared == "string"
    if isinstance(declared, list | tuple):
        return "string" in declared or not declared
    if "const" in schema:
        return isinstance(schema["const"], str)
    values = schema.get("enum")
    if isinstance(values, list) and values:
        return all(isinstance(value, str) for value in values)
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list) and branches and depth < _MAX_DEPTH:
        return all(_is_string_schema(branch, root, depth + 1) for branch in branches)
    return True


#: How deep alternatives and references are followed (schemas may be cyclic).
_MAX_DEPTH = 8


def resolved(schema: object, root: Mapping[str, object]) -> object:
    """``schema``, or what its local ``$ref`` (``#/$defs/Name``) points to
    in the tool's parameters ``root``."""
    for _ in range(_MAX_DEPTH):
        reference = schema.get("$ref") if isinstance(schema, Mapping) else None
        if not isinstance(reference, str) or not reference.startswith("#/"):
            return schema
        target: object = root
        for part in reference[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        schema = target
    return schema


class Qwen3CoderParser(ToolCallParser[CoderPhase]):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...``, several per reply."""

    def __init__(
        self, *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
    ) -> None:
        super().__init__(GRAMMAR, tools=tools, parallel_tool_calls=parallel_tool_calls)
        self._name_from = 0
        self._name: list[str] = []
        self._function: ToolSchema | None = None
        self._parameters = 0  # parameters opened in the committed call
        self._string_value = True
        self._value = MarkerScanner(_VALUE_END)
        #: A non-string value's (token, text) pieces, held until it closes.
        self._typed: list[tuple[int, str]] = []

    def _extra_held(self) -> int | None:
        typed = self._typed[0][0] if self._typed else None
        held = [owner for owner in (self._value.held_from, typed) if owner is not None]
        return min(held) if held else None

    def _after_literal(self, token: int, literal: str, out: list[Event]) -> None:
        if self._phase is _P.FUNCTION_NAME:
            self._name_from = self._held.length
            self._name = []
        elif literal == FUNCTION_CLOSE:
            out.append(self._argument(token, "}" if self._parameters else "{}"))
        elif self._phase is _P.TRAILING:
            self._end_call()

    def _abandon_call(self, token: int, out: list[Event]) -> None:
        # The JSON is closed unless </function> already closed it.
        if self._phase in (_P.BETWEEN, _P.PARAMETER_KEY):
            out.append(self._argument(token, "}" if self._parameters else "{}"))

    def _flush_call(self, out: list[Event]) -> None:
        for piece in self._value.finish():
            self._emit_value(piece.token, piece.text, out)
        # The reply ends inside a typed value: the JSON is cut off anyway.
        out.extend(self._argument(token, text) for token, text in self._typed)
        self._typed = []

    def _step(self, token: int, text: str, position: int, out: list[Event]) -> int:
        if self._phase is _P.FUNCTION_NAME:
            return self._on_function_name(token, text, position, out)
        if self._phase is _P.PARAMETER_KEY:
            return self._on_parameter_key(token, text, position, out)
        if self._phase is _P.VALUE_START:
            return self._on_value_start(token, text, position, out)
        if self._phase is _P.VALUE:
            return self._on_value(token, text, position, out)
        return self._on_trailing(token, text, position, out)

    def _on_function_name(self, token: int, text: str, position: int, out: list[Event]) -> int:
        end = name_run(_NAME_CHARS, text, position)
        if end > position:
            self._held.append(token, text[position:end])
            self._name.append(text[position:end])
        if end == len(text):
            return end
        if text[end] == ">" and self._name:
            self._function = self._tool("".join(self._name))
            self._parameters = 0
            name_from = self._name_from
            self._enter(_P.BETWEEN)
            self._commit(name_from, out)
            out.append(dropped(token, ">", Channel.TOOL_CALL))
            return end + 1
        self._break(token, out)
        return end

    def _on_parameter_key(self, token: int, text: str, position: int, out: list[Event]) -> int:
        end = name_run(_KEY_CHARS, text, position)
        if end > position:
            self._held.append(token, text[position:end])
        if end == len(text):
            return end
        if text[end] == ">" and self._held:
            self._open_parameter(token, out)
            return end + 1
        self._break(token, out)
        return end

    def _open_parameter(self, token: int, out: list[Event]) -> None:
        """``<parameter=KEY>`` is complete: emit ``{"KEY": `` (and ``"`` for a string)."""
        pieces = self._held.take_all()
        key = "".join(piece.text for piece in pieces)
        self._string_value = is_string_parameter(self._function, key)
        opening = "{" if self._parameters == 0 else ", "
        self._parameters += 1
        out.append(self._argument(pieces[0].token, opening + '"'))
        out.extend(self._argument(piece.token, json_escape(piece.text)) for piece in pieces)
        out.append(dropped(token, ">", Channel.TOOL_CALL))
        out.append(self._argument(token, '": "' if self._string_value else '": '))
        self._enter(_P.VALUE_START)

    def _on_value_start(self, token: int, text: str, position: int, out: list[Event]) -> int:
        self._enter(_P.VALUE)
        if text[position] == "\n":
            out.append(dropped(token, "\n", Channel.TOOL_CALL))
            return position + 1
        return position

    def _on_value(self, token: int, text: str, position: int, out: list[Event]) -> int:
        events, position = self._value.scan(token, text, position)
        for event in events:
            if isinstance(event, MarkerFound):
                out.extend(self._markup(list(event.pieces)))
                self._close_value(event.pieces[-1].token, out)
            else:
                self._emit_value(event.token, event.text, out)
        return position

    def _emit_value(self, token: int, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._string_value:
            out.append(self._argument(token, json_escape(text)))
        else:
            self._typed.append((token, text))

    def _close_value(self, token: int, out: list[Event]) -> None:
        if self._string_value:
            out.append(self._argument(token, '"'))
        else:
            out.extend(self._typed_value(token))
            self._typed = []
        self._enter(_P.BETWEEN)

    def _typed_value(self, closing: int) -> list[Event]:
        """The held value of a non-string parameter, as valid JSON (see the module doc)."""
        pieces = self._typed
        text = "".join(piece for _, piece in pieces)
        if not text.strip():
            # Whitespace is valid around a JSON value; the value itself is null.
            return [
                *(self._argument(t, piece) for t, piece in pieces),
                self._argument(closing, "null"),
            ]
        if is_json(text):
            return [self._argument(t, piece) for t, piece in pieces]
        literal = _PYTHON_LITERALS.get(text.strip())
        first = pieces[0][0]
        if literal is not None:
            # The first token owns the literal; the rest of the text is markup.
            rest = [dropped(t, piece, Channel.TOOL_CALL) for t, piece in pieces[1:]]
            return [self._argument(first, literal), *rest]
        return [
            self._argument(first, '"'),
            *(self._argument(t, json_escape(piece)) for t, piece in pieces),
            self._argument(closing, '"'),
        ]


def qwen3_coder(
    *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
) -> Qwen3CoderParser:
    return Qwen3CoderParser(tools=tools, parallel_tool_calls=parallel_tool_calls)


def forced_prefix(name: str | None) -> str:
    """The assistant prefix that forces a call (of ``name``, or of any tool)."""
    opening = f"{OPEN_TAG}\n{FUNCTION_OPEN}"
    return opening if name is None else f"{opening}{name}>\n"
