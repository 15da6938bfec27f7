"""The Hermes tool-call dialect (Qwen 2.5/3, Hermes, many others):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The arguments value is routed as it is generated, exactly as the model wrote
it; :class:`JsonExtent` only tracks nesting, strings and escapes to know where
the value ends (it does not validate). Everything else of the envelope is
tool-call markup.
"""

from __future__ import annotations

import enum
import re
from types import MappingProxyType

from sluiceway.parsers.events import Channel, Event, dropped
from sluiceway.parsers.stages import WHITESPACE
from sluiceway.parsers.tools.base import (
    CLOSE_TAG,
    OPEN_TAG,
    Grammar,
    ToolCallParser,
    ToolSchema,
    name_run,
)


class HermesPhase(enum.Enum):
    TEXT = "text"
    OPEN_BRACE = "open_brace"  # <tool_call> seen; expecting {
    NAME_KEY = "name_key"  # "name"
    NAME_COLON = "name_colon"
    NAME_QUOTE = "name_quote"
    NAME = "name"  # the name's characters, up to its closing quote (commits)
    ARGUMENTS_COMMA = "arguments_comma"  # , (or } for a call without arguments)
    ARGUMENTS_KEY = "arguments_key"  # "arguments"
    ARGUMENTS_COLON = "arguments_colon"
    ARGUMENTS_START = "arguments_start"  # whitespace, then the value's first character
    ARGUMENTS = "arguments"  # the value, streamed
    CLOSE_BRACE = "close_brace"
    CLOSE_TAG = "close_tag"  # </tool_call>
    TRAILING = "trailing"  # whitespace after </tool_call> is markup


_P = HermesPhase
_COMMITTED = frozenset(
    {
        _P.ARGUMENTS_COMMA,
        _P.ARGUMENTS_KEY,
        _P.ARGUMENTS_COLON,
        _P.ARGUMENTS_START,
        _P.ARGUMENTS,
        _P.CLOSE_BRACE,
        _P.CLOSE_TAG,
    }
)

GRAMMAR: Grammar[HermesPhase] = Grammar(
    text=_P.TEXT,
    envelope=_P.OPEN_BRACE,
    literals=MappingProxyType(
        {
            _P.OPEN_BRACE: (("{", _P.NAME_KEY),),
            _P.NAME_KEY: (('"name"', _P.NAME_COLON),),
            _P.NAME_COLON: ((":", _P.NAME_QUOTE),),
            _P.NAME_QUOTE: (('"', _P.NAME),),
            _P.ARGUMENTS_COMMA: ((",", _P.ARGUMENTS_KEY), ("}", _P.CLOSE_TAG)),
            _P.ARGUMENTS_KEY: (('"arguments"', _P.ARGUMENTS_COLON),),
            _P.ARGUMENTS_COLON: ((":", _P.ARGUMENTS_START),),
            _P.CLOSE_BRACE: (("}", _P.CLOSE_TAG),),
            _P.CLOSE_TAG: ((CLOSE_TAG, _P.TRAILING),),
        }
    ),
    committed=_COMMITTED,
    transitions=MappingProxyType(
        {
            _P.TEXT: frozenset({_P.OPEN_BRACE}),
            _P.OPEN_BRACE: frozenset({_P.NAME_KEY, _P.TEXT}),
            _P.NAME_KEY: frozenset({_P.NAME_COLON, _P.TEXT}),
            _P.NAME_COLON: frozenset({_P.NAME_QUOTE, _P.TEXT}),
            _P.NAME_QUOTE: frozenset({_P.NAME, _P.TEXT}),
            _P.NAME: frozenset({_P.ARGUMENTS_COMMA, _P.TEXT}),
            _P.ARGUMENTS_COMMA: frozenset({_P.ARGUMENTS_KEY, _P.CLOSE_TAG, _P.TEXT}),
            _P.ARGUMENTS_KEY: frozenset({_P.ARGUMENTS_COLON, _P.TEXT}),
            _P.ARGUMENTS_COLON: frozenset({_P.ARGUMENTS_START, _P.TEXT}),
            _P.ARGUMENTS_START: frozenset({_P.ARGUMENTS, _P.TEXT}),
            _P.ARGUMENTS: frozenset({_P.CLOSE_BRACE}),
            _P.CLOSE_BRACE: frozenset({_P.CLOSE_TAG, _P.TEXT}),
            _P.CLOSE_TAG: frozenset({_P.TRAILING, _P.TEXT}),
            _P.TRAILING: frozenset({_P.TEXT}),
        }
    ),
)

# A function name: no quote, backslash, angle bracket, whitespace or control
# character (OpenAI allows [a-zA-Z0-9_-]; we are lenient but keep "<" out, so
# that a broken envelope is never read more than twice).
_NAME_CHARS = re.compile(r'[^"\\<>\s\x00-\x1f]+')


class JsonExtent:
    """Where one streamed JSON value ends; tracks nesting, strings and escapes only.

    Objects, arrays and strings end at their closing character. A scalar
    (number, ``true``, ``null``...) ends before the first character that
    cannot be part of one, which is left for the envelope.
    """

    _STRUCTURE = re.compile(r'[{}\[\]"]')
    _STRING_STOP = re.compile(r'["\\]')
    _SCALAR = re.compile(r"[-+.0-9A-Za-z]*")
    STARTS = frozenset('{["-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ')

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scalar = False
        self._started = False

    def advance(self, text: str, position: int) -> tuple[int, bool]:
        """Read from ``position``; return how far the value reaches, and whether it ended."""
        if not self._started:
            self._start(text[position])
            position += 1
        if self._scalar:
            found = self._SCALAR.match(text, position)
            end = position if found is None else found.end()
            return end, end < len(text)
        return self._advance_nested(text, position)

    def _start(self, char: str) -> None:
        if char not in self.STARTS:
            raise ValueError(f"{char!r} cannot start a JSON value")
        self._started = True
        if char in "{[":
            self._depth = 1
        elif char == '"':
            self._in_string = True
        else:
            self._scalar = True

    def _advance_nested(self, text: str, position: int) -> tuple[int, bool]:
        while position < len(text):
            if self._escaped:
                self._escaped = False
                position += 1
            elif self._in_string:
                found = self._STRING_STOP.search(text, position)
                if found is None:
                    return len(text), False
                position = found.end()
                if found.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                    if self._depth == 0:
                        return position, True  # a top-level string value
            else:
                found = self._STRUCTURE.search(text, position)
                if found is None:
                    return len(text), False
                position = found.end()
                char = found.group()
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        return position, True
        return position, False


class HermesParser(ToolCallParser[HermesPhase]):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, several per reply."""

    def __init__(
        self, *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
    ) -> None:
        super().__init__(GRAMMAR, tools=tools, parallel_tool_calls=parallel_tool_calls)
        self._name_from = 0
        self._has_arguments = False
        self._extent = JsonExtent()

    def _after_literal(self, token: int, literal: str, out: list[Event]) -> None:
        if self._phase is _P.NAME:
            self._name_from = self._held.length
            self._has_arguments = False
        elif self._phase is _P.CLOSE_TAG and not self._has_arguments:
            # {"name": "f"} with no arguments: clients parse arguments as JSON,
            # so the call gets an empty object, owned by the closing brace.
            out.append(self._argument(token, "{}"))
            self._has_arguments = True
        elif self._phase is _P.TRAILING:
            self._end_call()

    def _step(self, token: int, text: str, position: int, out: list[Event]) -> int:
        if self._phase is _P.NAME:
            return self._on_name(token, text, position, out)
        if self._phase is _P.ARGUMENTS_START:
            return self._on_arguments_start(token, text, position, out)
        if self._phase is _P.ARGUMENTS:
            return self._on_arguments(token, text, position, out)
        return self._on_trailing(token, text, position, out)

    def _on_name(self, token: int, text: str, position: int, out: list[Event]) -> int:
        end = name_run(_NAME_CHARS, text, position)
        if end > position:
            self._held.append(token, text[position:end])
        if end == len(text):
            return end
        if text[end] == '"' and self._held.length > self._name_from:
            name_from = self._name_from
            self._enter(_P.ARGUMENTS_COMMA)
            self._commit(name_from, out)
            out.append(dropped(token, '"', Channel.TOOL_CALL))
            return end + 1
        self._break(token, out)
        return end

    def _on_arguments_start(self, token: int, text: str, position: int, out: list[Event]) -> int:
        self._has_arguments = True
        char = text[position]
        if char in WHITESPACE:
            self._hold_or_drop(token, char, out)
            return position + 1
        if char not in JsonExtent.STARTS:
            self._break(token, out)  # "arguments": followed by no value
            return position
        self._extent = JsonExtent()
        self._enter(_P.ARGUMENTS)
        return position

    def _on_arguments(self, token: int, text: str, position: int, out: list[Event]) -> int:
        end, done = self._extent.advance(text, position)
        if end > position:
            out.append(self._argument(token, text[position:end]))
        if done:
            self._enter(_P.CLOSE_BRACE)
        return end


def hermes(*, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True) -> HermesParser:
    return HermesParser(tools=tools, parallel_tool_calls=parallel_tool_calls)


def forced_prefix(name: str | None) -> str:
    """The assistant prefix that forces a call (of ``name``, or of any tool)."""
    opening = f'{OPEN_TAG}\n{{"name": "'
    return opening if name is None else f'{opening}{name}", "arguments": '
