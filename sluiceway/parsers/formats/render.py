"""Calls written in a format's markup, from its description.

The canonical rendering (whitespace as ``pre`` says, the first option of
every choice, optional literals left out) gives the forced prefix of a
required or named ``tool_choice``; a :class:`Style` that draws whitespace and
options gives the test strings every parser and grammar must accept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluiceway.parsers.formats.spec import (
    Choice,
    Index,
    JsonArguments,
    Key,
    Lit,
    Name,
    Opt,
    Part,
    PythonArguments,
    PythonValue,
    Repeat,
    Seq,
    Tagged,
    ToolFormat,
    Value,
    kinds,
)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: Mapping[str, Any]


class Style:
    """The canonical choices; tests override them."""

    def space(self, pre: str) -> str:
        """Whitespace where optional whitespace may go (``pre``: the canonical one)."""
        return pre

    def newline(self, pre: str) -> str:
        """The optional newline at either end of a tagged value."""
        return pre

    def pick(self, count: int) -> int:
        """Which of ``count`` options (of a choice, or absent/present for an
        optional literal)."""
        return 0


class _Stop(Exception):
    pass


class _Renderer:
    def __init__(self, fmt: ToolFormat, calls: Sequence[Call], style: Style) -> None:
        self.calls = calls
        self.style = style
        self.call = -1
        self.items: list[tuple[str, Any]] = []
        self.stop_at_name = False
        self.stop_at_arguments = False
        self.out: list[str] = []
        self.opening = True

    def write(self, part: Part) -> None:
        if isinstance(part, Lit):
            # Whitespace before the markup's first literal is the caller's.
            spaced = not part.tight and not self.opening
            self.opening = False
            self.out += [self.style.space(part.pre) if spaced else "", part.text]
        elif isinstance(part, Seq):
            for inner in part.parts:
                self.write(inner)
        elif isinstance(part, Choice):
            self.write(part.options[self.style.pick(len(part.options))])
        elif isinstance(part, Opt):
            if self._wanted(part.part):
                self.write(part.part)
        elif isinstance(part, Repeat):
            while self._wanted(part.part):
                self.write(part.part)
        elif isinstance(part, Tagged | PythonArguments):
            if self.stop_at_arguments:
                self.out.append(part.open.pre if isinstance(part, Tagged) else "")
                raise _Stop
            self.write(part.part())
        else:
            self._reader(part)

    def _wanted(self, part: Part) -> bool:
        held = kinds(part)
        if Name in held:
            return self.call + 1 < len(self.calls)
        if Key in held:
            return bool(self.items)
        if JsonArguments in held:
            return True
        return self.style.pick(2) == 1

    def _reader(self, part: Part) -> None:
        if isinstance(part, Name):
            if self.stop_at_name:
                raise _Stop
            self.call += 1
            call = self.calls[self.call]
            self.items = list(call.arguments.items())
            self.out += [self.style.space(part.pre) if part.ws else "", call.name]
        elif isinstance(part, Index):
            self.out.append(str(self.call))
        elif isinstance(part, JsonArguments):
            self.out.append(self.style.space(part.pre))
            if self.stop_at_arguments:
                raise _Stop
            arguments = dict(self.items)
            self.items = []
            self.out.append(json.dumps(arguments, ensure_ascii=False))
        elif isinstance(part, Key):
            space = self.style.space(part.pre) if part.ws else ""
            self.out += [space, self.items[0][0]]
        elif isinstance(part, Value):
            self._value(part, self.items.pop(0)[1])
        elif isinstance(part, PythonValue):
            self.out.append(python_literal(self.items.pop(0)[1]))

    def _value(self, part: Value, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        before = "\n" if text.startswith("\n") else self.style.newline(part.pre)
        after = "\n" if text.endswith("\n") else self.style.newline(part.pre)
        self.out += [before, text, after, part.close]


def render(fmt: ToolFormat, calls: Sequence[Call], style: Style | None = None) -> str:
    """``calls`` in ``fmt``'s markup."""
    style = style or Style()
    renderer = _Renderer(fmt, calls, style)
    renderer.write(fmt.body)
    # Formats whose markup holds one call write the next ones after it.
    while renderer.call + 1 < len(calls):
        renderer.out.append(style.space("\n"))
        renderer.opening = True
        renderer.write(fmt.body)
    return "".join(renderer.out)


def forced_prefix(fmt: ToolFormat, name: str | None) -> str:
    """The assistant prefix that forces a call: of any tool (``None``), up to
    its name, or of the named one, up to its arguments."""
    renderer = _Renderer(fmt, [Call(name or "", {})], Style())
    renderer.stop_at_name = name is None
    renderer.stop_at_arguments = name is not None
    try:
        renderer.write(fmt.body)
    except _Stop:
        return "".join(renderer.out)
    raise ValueError(f"{fmt.name}: a call has no name or no arguments to stop at")


def python_literal(value: Any) -> str:
    """A JSON value as Python source (``true`` -> ``True``)."""
    if isinstance(value, bool) or value is None or isinstance(value, int | float | str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"not a JSON value: {value!r}")
