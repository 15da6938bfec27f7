"""A JSON object from text that should be one: a tool call's arguments as the
model writes them, for a surface that promises clients an object.

Theory of operation. :class:`ObjectGuard` is fed the text piece by piece and
returns what may go out: the text itself while it is a valid prefix of a JSON
object, so a well-formed object passes through unchanged, as it streams. It
never takes back what it let out, so where the text goes wrong it repairs
what it can and cuts what it cannot:

- A raw control character inside a string (a newline in code) goes out
  escaped; an invalid escape (``\\x``) goes out as an escaped backslash and
  the character.
- At the first character that no JSON object could continue with, the rest
  of the text is dropped, and the prefix let out so far is closed.
- :meth:`ObjectGuard.finish` closes whatever is still open (arguments cut off
  by ``max_tokens``): an unterminated string gets its quote, a number that
  cannot end where it stands gets a ``0`` (``1.`` -> ``1.0``), a literal is
  completed (``tr`` -> ``true``), a key without a value gets ``null``, and
  every open array and object is closed. A comma is held until what follows
  it starts, so a dangling one is dropped rather than repaired.
- Text that does not begin an object (an array, a string, nothing at all)
  becomes ``{}``.

So the concatenated output is always one JSON object, whatever the split.
"""

from __future__ import annotations

import enum

_WHITESPACE = frozenset(" \t\n\r")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
#: How a raw control character inside a string goes out.
_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


class _State(enum.Enum):
    START = "start"  # before the object: whitespace, then "{"
    KEY_OR_CLOSE = "key_or_close"  # after "{": a key or "}"
    KEY = "key"  # after "," in an object
    COLON = "colon"  # after a key
    VALUE = "value"  # after ":", or after "," in an array
    VALUE_OR_CLOSE = "value_or_close"  # after "["
    AFTER_VALUE = "after_value"  # "," or the container's close
    STRING = "string"  # inside a key or a string value
    NUMBER = "number"
    LITERAL = "literal"  # true, false, null
    DONE = "done"  # the object is closed: only whitespace may follow
    BROKEN = "broken"  # the text stopped being JSON: the rest is dropped


class _Number(enum.Enum):
    """Where a number stands in JSON's number grammar."""

    SIGN = "sign"
    ZERO = "zero"
    INTEGER = "integer"
    POINT = "point"
    FRACTION = "fraction"
    E = "e"
    EXPONENT_SIGN = "exponent_sign"
    EXPONENT = "exponent"


def _number_step(state: _Number | None, char: str) -> _Number | None:
    """The number's next state after ``char`` (None: ``char`` cannot continue it)."""
    digit = char in _DIGITS
    if state is None:  # the first character
        if char == "-":
            return _Number.SIGN
        return _Number.ZERO if char == "0" else _Number.INTEGER if digit else None
    if state is _Number.SIGN:
        return _Number.ZERO if char == "0" else _Number.INTEGER if digit else None
    if state in (_Number.ZERO, _Number.INTEGER, _Number.FRACTION):
        if digit and state is not _Number.ZERO:
            return state
        if char == "." and state is not _Number.FRACTION:
            return _Number.POINT
        return _Number.E if char in "eE" else None
    if state is _Number.POINT:
        return _Number.FRACTION if digit else None
    if state is _Number.E and char in "+-":
        return _Number.EXPONENT_SIGN
    return _Number.EXPONENT if digit else None


#: Numbers that may end where they stand.
_COMPLETE_NUMBERS = frozenset({_Number.ZERO, _Number.INTEGER, _Number.FRACTION, _Number.EXPONENT})


class ObjectGuard:
    """Lets through the longest prefix of a text that a JSON object could
    start with, and closes it (see the module comment)."""

    def __init__(self) -> None:
        self._state = _State.START
        self._containers: list[str] = []  # "}" or "]" for each open container
        self._held = ""  # a comma (and whitespace after it) until what follows starts
        self._escape = ""  # an escape in progress inside a string, not yet let out
        self._in_key = False
        self._number: _Number | None = None
        self._literal = ""  # the literal being written
        self._literal_done = 0

    def feed(self, text: str) -> str:
        """What of ``text`` goes out."""
        out: list[str] = []
        for char in text:
            self._step(char, out)
        return "".join(out)

    def finish(self) -> str:
        """What closes the object (all of it, if nothing began one)."""
        closing = self._closing()
        self._state = _State.DONE
        return closing

    # -- the grammar

    def _step(self, char: str, out: list[str]) -> None:
        state = self._state
        if state is _State.STRING:
            self._string(char, out)
        elif state is _State.NUMBER:
            self._number_char(char, out)
        elif state is _State.LITERAL:
            self._literal_char(char, out)
        elif state is _State.BROKEN:
            return
        elif char in _WHITESPACE:
            if self._held:
                self._held += char
            else:
                out.append(char)
        elif state is _State.START:
            self._start(char, out)
        elif state in (_State.KEY_OR_CLOSE, _State.KEY):
            self._key(char, out)
        elif state is _State.COLON:
            self._expect(char, ":", _State.VALUE, out)
        elif state in (_State.VALUE, _State.VALUE_OR_CLOSE):
            self._value(char, out)
        elif state is _State.AFTER_VALUE:
            self._after_value(char, out)
        else:  # DONE: anything but whitespace is trailing text
            self._break(out)

    def _start(self, char: str, out: list[str]) -> None:
        if char != "{":
            self._break(out)
            return
        self._open("}", _State.KEY_OR_CLOSE, char, out)

    def _key(self, char: str, out: list[str]) -> None:
        if char == '"':
            self._let_out(char, out)
            self._in_key = True
            self._state = _State.STRING
        elif char == "}" and self._state is _State.KEY_OR_CLOSE:
            self._close(char, out)
        else:
            self._break(out)

    def _expect(self, char: str, wanted: str, then: _State, out: list[str]) -> None:
        if char != wanted:
            self._break(out)
            return
        out.append(char)
        self._state = then

    def _value(self, char: str, out: list[str]) -> None:
        if char == "]" and self._state is _State.VALUE_OR_CLOSE:
            self._close(char, out)
        elif char == '"':
            self._let_out(char, out)
            self._in_key = False
            self._state = _State.STRING
        elif char == "{":
            self._open("}", _State.KEY_OR_CLOSE, char, out)
        elif char == "[":
            self._open("]", _State.VALUE_OR_CLOSE, char, out)
        elif char in _LITERALS:
            self._let_out(char, out)
            self._literal, self._literal_done = _LITERALS[char], 1
            self._state = _State.LITERAL
        elif (number := _number_step(None, char)) is not None:
            self._let_out(char, out)
            self._number = number
            self._state = _State.NUMBER
        else:
            self._break(out)

    def _after_value(self, char: str, out: list[str]) -> None:
        if char == ",":
            self._held = char
            self._state = _State.KEY if self._containers[-1] == "}" else _State.VALUE
        elif char == self._containers[-1]:
            self._close(char, out)
        else:
            self._break(out)

    def _string(self, char: str, out: list[str]) -> None:
        if self._escape:
            self._escaped(char, out)
        elif char == "\\":
            self._escape = char
        elif char == '"':
            out.append(char)
            self._state = _State.COLON if self._in_key else self._after()
        elif char < " ":
            out.append(_CONTROL_ESCAPES.get(char) or f"\\u{ord(char):04x}")
        else:
            out.append(char)

    def _escaped(self, char: str, out: list[str]) -> None:
        """The character after a backslash (or within ``\\uXXXX``)."""
        escape = self._escape
        if escape == "\\" and char in _ESCAPES:
            out.append(escape + char)
        elif (escape == "\\" and char == "u") or (escape.startswith("\\u") and char in _HEX):
            self._escape += char
            if len(self._escape) == len("\\u0000"):
                out.append(self._escape)
                self._escape = ""
            return
        else:  # not an escape: the backslash was a character of the text
            self._escape = ""
            out.append("\\\\" + escape[1:])
            self._string(char, out)
            return
        self._escape = ""

    def _number_char(self, char: str, out: list[str]) -> None:
        step = _number_step(self._number, char)
        if step is not None:
            out.append(char)
            self._number = step
            return
        out.append(self._number_end())
        self._state = self._after()
        self._step(char, out)

    def _literal_char(self, char: str, out: list[str]) -> None:
        if char == self._literal[self._literal_done]:
            out.append(char)
            self._literal_done += 1
            if self._literal_done == len(self._literal):
                self._state = self._after()
            return
        out.append(self._literal[self._literal_done :])
        self._state = self._after()
        self._step(char, out)

    # -- containers and ends

    def _let_out(self, char: str, out: list[str]) -> None:
        """A token starts: a comma held before it goes out first."""
        out.append(self._held + char)
        self._held = ""

    def _open(self, closer: str, then: _State, char: str, out: list[str]) -> None:
        self._let_out(char, out)
        self._containers.append(closer)
        self._state = then

    def _close(self, char: str, out: list[str]) -> None:
        out.append(char)
        self._containers.pop()
        self._state = self._after()

    def _after(self) -> _State:
        return _State.AFTER_VALUE if self._containers else _State.DONE

    def _number_end(self) -> str:
        return "" if self._number in _COMPLETE_NUMBERS else "0"

    def _break(self, out: list[str]) -> None:
        out.append(self._closing())
        self._state = _State.BROKEN

    def _closing(self) -> str:
        """What closes the prefix let out so far."""
        state = self._state
        if state is _State.START:
            return "{}"
        if state in (_State.DONE, _State.BROKEN):
            return ""
        self._held = ""  # a dangling comma never went out
        if state is _State.STRING:
            self._escape = ""
            tail = '": null' if self._in_key else '"'
        elif state is _State.NUMBER:
            tail = self._number_end()
        elif state is _State.LITERAL:
            tail = self._literal[self._literal_done :]
        elif state is _State.COLON:
            tail = ": null"
        elif state is _State.VALUE and self._containers[-1] == "}":
            tail = "null"  # after a key's colon
        else:
            tail = ""
        return tail + "".join(reversed(self._containers))
