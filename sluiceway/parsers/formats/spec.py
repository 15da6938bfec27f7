"""The words a tool-call format is described in.

A format family is *data*: one :class:`ToolFormat` whose ``body`` spells the
markup of a reply's calls with the parts below, from the first opening tag to
the last closing one. Three things are derived from that one description, so
they cannot disagree:

- the streaming parser (:mod:`sluiceway.parsers.formats.parser`), which walks
  the description compiled into a graph (:mod:`~sluiceway.parsers.formats.graph`);
- the structured-output grammar of strict tools and forced calls
  (:mod:`sluiceway.surfaces.tool_grammar`), written part by part;
- the canonical rendering of calls (:mod:`~sluiceway.parsers.formats.render`),
  which gives the forced prefix of a named ``tool_choice`` and the test strings.

Whitespace: optional whitespace may come before every literal unless it is
``tight``, and before a reader only where it says ``ws``. ``pre`` is the
whitespace the canonical rendering writes there (what the family's models
write). The parser takes any run of whitespace there; the grammar at most
:data:`MAX_WHITESPACE` characters, so that a constrained model cannot stall in
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The longest run of optional whitespace the grammar allows between parts.
MAX_WHITESPACE = 4


@dataclass(frozen=True, slots=True)
class Lit:
    """Fixed markup text."""

    text: str
    pre: str = ""
    tight: bool = False
    #: The first markup after a call's arguments: arguments the parser
    #: builds (from parameters) close here, and a call without any gets ``{}``.
    ends_args: bool = False
    #: Closes a parameter's key: the built arguments continue with ``": "``.
    closes_key: bool = False


@dataclass(frozen=True, slots=True)
class Name:
    """The function's name; a call commits (is reported) when it is complete."""

    pre: str = ""
    ws: bool = False


@dataclass(frozen=True, slots=True)
class Index:
    """Decimal digits numbering the call (part of the call's id)."""

    ws: bool = False


@dataclass(frozen=True, slots=True)
class JsonArguments:
    """The arguments as one JSON object, streamed exactly as written."""

    pre: str = ""
    ws: bool = True


@dataclass(frozen=True, slots=True)
class Key:
    """A parameter's name; ``python`` keys are identifiers."""

    pre: str = ""
    ws: bool = False
    python: bool = False


@dataclass(frozen=True, slots=True)
class Value:
    """A parameter's value as text, up to and including ``close``; one newline
    right after the opening and one right before ``close`` are markup."""

    close: str
    pre: str = ""
    ws: bool = False


@dataclass(frozen=True, slots=True)
class PythonValue:
    """A parameter's value as a Python literal, up to ``,`` or ``)`` (its
    whitespace is its own)."""

    ws: bool = False


@dataclass(frozen=True, slots=True)
class Seq:
    parts: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the options; the first is the canonical one."""

    options: tuple[Part, ...]


@dataclass(frozen=True, slots=True)
class Opt:
    part: Part


@dataclass(frozen=True, slots=True)
class Repeat:
    """Zero or more times (the part must not match the empty string)."""

    part: Part


def seq(*parts: Part) -> Seq:
    return Seq(parts)


def choice(*options: Part) -> Choice:
    return Choice(options)


@dataclass(frozen=True, slots=True)
class Tagged:
    """Parameters as tagged blocks: ``OPEN key CLOSE_KEY [VALUE_OPEN] value CLOSE``.

    Kept whole (not only spelled in parts) because the grammar of a strict
    tool writes it per property of the schema, in the schema's order, with
    the required ones present.
    """

    open: Lit
    close_key: Lit
    value_open: Lit | None
    close: str
    value_pre: str = ""

    def part(self) -> Part:
        """The same markup spelled in parts, for the parser and the renderer."""
        parts: list[Part] = [self.open, Key(), self.close_key]
        if self.value_open is not None:
            parts.append(self.value_open)
        parts.append(Value(self.close, pre=self.value_pre))
        return Repeat(Seq(tuple(parts)))


@dataclass(frozen=True, slots=True)
class PythonArguments:
    """``key=value, key=value`` between a call's parentheses (pythonic calls)."""

    def part(self) -> Part:
        first = seq(Key(python=True), Lit("=", tight=True, closes_key=True), PythonValue())
        rest = seq(
            Lit(","),
            Key(python=True, ws=True, pre=" "),
            Lit("=", tight=True, closes_key=True),
            PythonValue(),
        )
        return Opt(seq(first, Repeat(rest)))


Reader = Name | Index | JsonArguments | Key | Value | PythonValue
#: Parts that the grammar writes whole (see :class:`Tagged`).
Compound = Tagged | PythonArguments
Part = Lit | Reader | Seq | Choice | Opt | Repeat | Compound


def kinds(part: Part) -> set[type]:
    """The kinds of reader and literal ``part`` holds, at any depth."""
    if isinstance(part, Seq):
        return set().union(*(kinds(inner) for inner in part.parts))
    if isinstance(part, Choice):
        return set().union(*(kinds(option) for option in part.options))
    if isinstance(part, Opt | Repeat):
        return kinds(part.part)
    if isinstance(part, Tagged | PythonArguments):
        return kinds(part.part())
    return {type(part)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolFormat:
    """One family's tool-call markup."""

    name: str
    body: Part
    #: Calls may only open the reply (after whitespace): later text is content.
    at_start: bool = False
    #: The call's id, from its name and index (``functions.{name}:{index}``);
    #: None: the server mints one.
    call_id: str | None = None
    #: Characters a function name may hold (a regex character class).
    name_chars: str = r'[^"\\<>\s\x00-\x1f]'
    #: Markup that the family's tokenizers have as single special tokens.
    special: tuple[str, ...] = field(default=())
