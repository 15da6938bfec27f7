"""Reading and typing arguments: where a JSON or Python value ends, and what
JSON a parameter written as text becomes.

Formats that write values as text (tagged parameters, Python calls) are
typed by the tool's schema: a parameter typed ``string`` (or unknown) is a
JSON string of its text; any other value is read as JSON (or a Python
literal) and passed on when it parses -- an integer written ``140.0`` becomes
``140`` where the schema asks for an integer -- and is otherwise kept as a
string rather than dropping the call.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSchema:
    """A tool the request offers: its function name and JSON schema of parameters."""

    name: str
    parameters: Mapping[str, Any]


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
    return _is_string_schema(_property(tool, key), tool.parameters)


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


def parameter_schema(tool: ToolSchema | None, key: str) -> object:
    """The schema of ``key`` in ``tool``'s parameters (its ``$ref`` resolved), or None."""
    if tool is None:
        return None
    return resolved(_property(tool, key), tool.parameters)


def _property(tool: ToolSchema, key: str) -> object:
    properties = tool.parameters.get("properties")
    return properties.get(key) if isinstance(properties, Mapping) else None


def typed_json(text: str, schema: object) -> str:
    """A non-string parameter's text as JSON (see the module doc)."""
    stripped = text.strip()
    if not stripped:
        return "null"
    if is_json(stripped):
        fixed = _as_integer(stripped, schema)
        return text if fixed == stripped else fixed
    literal = _PYTHON_LITERALS.get(stripped)
    if literal is not None:
        return literal
    return json.dumps(text, ensure_ascii=False)


def _as_integer(text: str, schema: object) -> str:
    """``140.0`` is ``140`` where the schema asks for an integer."""
    declared = schema.get("type") if isinstance(schema, Mapping) else None
    if declared != "integer" or not re.fullmatch(
        r"-?\d+\.0*(?:[eE][+-]?\d+)?|-?\d+[eE]\+?\d+", text
    ):
        return text
    value = float(text)
    return str(int(value)) if math.isfinite(value) and value.is_integer() else text


def python_json(text: str, schema: object) -> str:
    """A Python literal as JSON; text that is none is kept as a string."""
    try:
        value = ast.literal_eval(text.strip())
        out = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return json.dumps(text.strip(), ensure_ascii=False)
    return _as_integer(out, schema)


class PythonExtent:
    """Where one streamed Python literal ends: before a ``,`` or ``)`` outside
    brackets and strings (the end is left for the envelope)."""

    def __init__(self) -> None:
        self._depth = 0
        self._quote = ""
        self._escaped = False

    def advance(self, text: str, position: int) -> tuple[int, bool]:
        """Read from ``position``; return how far the value reaches, and whether it ended."""
        while position < len(text):
            char = text[position]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = ""
            elif char in "'\"":
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                if self._depth == 0:
                    return position, True
                self._depth -= 1
            elif char == "," and self._depth == 0:
                return position, True
            position += 1
        return position, False
