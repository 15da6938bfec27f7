"""The streaming tool-call parser of every format: one walker over a format's graph.

Theory of operation. The parser reads content (reasoning and other channels
pass through). In *text* a :class:`MarkerScanner` looks for the literals that
open the format's markup (for ``at_start`` formats only at the very start of
the reply, after whitespace). From there it walks the graph
(:mod:`sluiceway.parsers.formats.graph`), one node at a time:

- Before a call's name is complete the markup is *uncommitted*: every
  character is held, since if the markup breaks it is all ordinary content.
  On a break the first held character is released as content and the rest is
  read again as text (it cannot open the same markup at the same place, so
  nothing is read more than twice); prompt text from :meth:`prime` is dropped
  instead, it was never output.
- When the name is complete (and, for formats whose call id holds it, the
  call's index) the call is *committed*: :class:`ToolCallOpened` goes out and
  the held markup is dropped as tool-call markup. From then on whitespace is
  dropped at once, and only a literal in progress is held. A committed call
  whose markup breaks ends there; the partial literal is read again as text.
- Arguments written as JSON stream exactly as written. Arguments written as
  parameters (tagged blocks, Python keywords) are built into one JSON object
  while they stream: ``{"KEY": `` when the key's value starts (a call whose
  markup breaks between a key and its value drops the key, so the built
  object stays whole JSON), a string value escaped piece by piece, any
  other value held until it ends and then typed by the tool's schema
  (:mod:`~sluiceway.parsers.formats.arguments`), and the closing brace at
  the literal that ends the arguments. Built punctuation is owned by the
  token whose text called for it.
- Where the markup may end (the graph's end), whitespace is markup and any
  other text ends the markup cleanly: it is read again as text.

With ``parallel_tool_calls=False`` a second committed call is *suppressed*:
the markup is walked as usual, but its name and arguments are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluiceway.parsers.events import (
    PROMPT_OWNER,
    Channel,
    Event,
    Span,
    ToolCallOpened,
    content,
    dropped,
)
from sluiceway.parsers.formats.arguments import (
    JsonExtent,
    PythonExtent,
    ToolSchema,
    is_string_parameter,
    json_escape,
    parameter_schema,
    python_json,
)
from sluiceway.parsers.formats.graph import Graph, State
from sluiceway.parsers.formats.spec import (
    Index,
    JsonArguments,
    Key,
    Lit,
    Name,
    PythonValue,
    Reader,
    Value,
)
from sluiceway.parsers.formats.values import ValueReader
from sluiceway.parsers.markers import HeldText, MarkerFound, MarkerScanner, MarkerSet, OwnedText
from sluiceway.parsers.stages import WHITESPACE, PrimeError, SpanStage, spans_of


class FormatParser(SpanStage):
    """The last stage of a choice's text path: content -> content/tool calls/markup."""

    def __init__(
        self,
        graph: Graph,
        *,
        tools: tuple[ToolSchema, ...] = (),
        parallel_tool_calls: bool = True,
    ) -> None:
        super().__init__((Channel.CONTENT,))
        self._graph = graph
        self._tools = {tool.name: tool for tool in tools}
        self._parallel = parallel_tool_calls
        entry = graph.entry
        self._entry = {lit.text: state for lit, state in entry}
        self._scanner = MarkerScanner(MarkerSet(self._entry))
        self._state: State | None = None  # None: in text
        self._held = HeldText()  # the uncommitted markup, or a literal in progress
        self._literal = ""
        self._spaced = False  # whitespace came at this node (a tight literal is out)
        self._committed = False
        self._reported = 0
        self._index = -1
        self._suppressed = False
        self._seen_text = False  # at_start formats: content came, no calls any more
        self._primed: list[Event] = []
        # The reader in progress and what it keeps.
        self._reader: Reader | None = None
        self._run: list[OwnedText] = []  # a name, index or key as it arrives
        self._name = ""
        self._name_from = 0
        self._json = JsonExtent()
        self._python = PythonExtent()
        self._value: ValueReader | None = None
        self._function: ToolSchema | None = None
        self._arguments = 0  # built parameters so far (-1: written as JSON)
        self._args_open = False  # the committed call's arguments are not closed yet
        self._pending_name = False  # a name is complete, the call not yet reported
        self._name_to = 0
        self._key = ""
        self._python_key = False
        # A complete key waits for its value: its pieces, and the token of
        # the literal that closed it (None: not closed yet).
        self._key_run: list[OwnedText] = []
        self._key_closer: int | None = None
        self._needs_index = graph.format.call_id is not None and "{index}" in graph.format.call_id
        self._call_index: str | None = None
        self._after: State = graph.start

    # -- the TextStage surface

    @property
    def held_from(self) -> int | None:
        owners = [
            self._scanner.held_from,
            self._held.first_owner_at_least(0),
            self._run[0].token if self._run else None,
            self._key_run[0].token if self._key_run else None,
            self._value.held_from if self._value is not None else None,
        ]
        real = [owner for owner in owners if owner is not None and owner >= 0]
        return min(real) if real else None

    def open_channel(self, upstream: Channel) -> Channel:
        inside = self._state is not None and self._committed
        if inside and self._state is not None and not self._state.options.end_only:
            return Channel.TOOL_CALL
        return upstream

    def feed(self, events: Sequence[Event]) -> list[Event]:
        out = super().feed(events)
        return self._with_primed(out)

    def finish(self) -> list[Event]:
        return self._with_primed(super().finish())

    def _with_primed(self, out: list[Event]) -> list[Event]:
        if self._primed:
            out[:0] = self._primed
            self._primed = []
        return out

    def prime(self, text: str) -> None:
        """Read a forced assistant prefix (a tool call the prompt already opened)."""
        if self._started:
            raise PrimeError("a tool-call parser can only be primed before it is fed")
        out: list[Event] = []
        self._feed_owned(PROMPT_OWNER, text, out)
        for event in out:
            if isinstance(event, ToolCallOpened):
                self._primed.append(event)
            elif event.channel is not Channel.DROPPED:
                raise PrimeError(f"{text!r} does not start a tool call")
        if text and self._state is None:
            raise PrimeError(f"{text!r} does not leave a tool call open")

    # -- routing

    def _feed_text(self, span: Span, out: list[Event]) -> None:
        self._feed_owned(span.token, span.text, out)

    def _feed_owned(self, token: int, text: str, out: list[Event]) -> None:
        position = 0
        while position < len(text):
            if self._state is None:
                position = self._scan_text(token, text, position, out)
            elif self._reader is not None:
                position = self._read(token, text, position, out)
            else:
                position = self._expect(token, text, position, out)

    def _flush(self, out: list[Event]) -> None:
        # Uncommitted markup is content; reading it again may hold more
        # markup, so repeat (each round releases at least one character).
        while self._state is not None and not self._committed and self._held:
            self._break_uncommitted(out)
        if self._state is not None and self._committed:
            self._literal = ""
            out.extend(self._markup(self._held.take_all()))
            out.extend(self._markup(self._key_run))
            self._key_run = []
            self._flush_reader(out)
        # A reply of at_start markup's leading whitespace or part of its first
        # literal: held outside any markup, and content after all.
        out.extend(_content_or_dropped(self._held.take_all()))
        out.extend(_content_or_dropped(self._scanner.finish()))

    # -- text

    def _scan_text(self, token: int, text: str, position: int, out: list[Event]) -> int:
        if self._graph.format.at_start:
            return self._scan_start(token, text, position, out)
        events, position = self._scanner.scan(token, text, position)
        for event in events:
            if isinstance(event, MarkerFound):
                for piece in event.pieces:
                    self._held.append(piece.token, piece.text)
                self._open(self._entry[event.marker])
                break
            out.extend(_content_or_dropped((event,)))
        return position

    def _scan_start(self, token: int, text: str, position: int, out: list[Event]) -> int:
        """Markup only opens the reply: leading whitespace is held with it."""
        if self._seen_text:
            out.extend(_content_or_dropped((OwnedText(token, text[position:]),)))
            return len(text)
        char = text[position]
        if not self._literal and char in WHITESPACE:
            self._held.append(token, char)
            return position + 1
        candidate = self._literal + char
        alive = [literal for literal in self._entry if literal.startswith(candidate)]
        if not alive:
            self._seen_text = True
            self._literal = ""
            pieces = self._held.take_all()
            out.extend(_content_or_dropped(pieces))
            return position
        self._held.append(token, char)
        self._literal = candidate
        if candidate in self._entry:
            self._literal = ""
            self._open(self._entry[candidate])
        return position + 1

    def _open(self, state: State) -> None:
        self._committed = False
        self._pending_name = False
        self._enter(state)

    def _enter(self, state: State) -> None:
        self._state = state
        self._spaced = False

    # -- literals

    def _expect(self, token: int, text: str, position: int, out: list[Event]) -> int:
        assert self._state is not None
        options = self._state.options
        char = text[position]
        if not self._literal:
            if char in WHITESPACE and options.whitespace:
                self._spaced = True
                self._hold_or_drop(token, char, out)
                return position + 1
            reader = options.reader
            if reader is not None and self._starts_reader(reader[0], char):
                self._open_value(out)
                self._reader = reader[0]
                self._begin_reader(reader[0], reader[1])
                return position
        candidate = self._literal + char
        alive = [
            (lit, nxt)
            for lit, nxt in options.literals
            if lit.text.startswith(candidate) and not (lit.tight and self._spaced)
        ]
        if not alive:
            self._break(token, out, at_end=options.end)
            return position
        self._held.append(token, char)
        self._literal = candidate
        for lit, nxt in alive:
            if lit.text == candidate:
                self._literal = ""
                self._complete_literal(token, lit, out)
                self._enter(nxt)
                break
        return position + 1

    def _starts_reader(self, reader: Reader, char: str) -> bool:
        if self._spaced and not reader.ws:
            return False
        if isinstance(reader, Name):
            return self._graph.name_chars.match(char) is not None
        if isinstance(reader, Index):
            return char.isdigit()
        if isinstance(reader, Key):
            return _is_key_char(char, python=reader.python)
        if isinstance(reader, JsonArguments):
            return char in JsonExtent.STARTS
        return True  # values take any first character

    def _complete_literal(self, token: int, lit: Lit, out: list[Event]) -> None:
        if self._pending_name and (self._call_index is not None or not self._needs_index):
            # The markup after the name holds: the call is reported.
            self._commit(out)
        elif self._committed and not self._pending_name:
            out.extend(self._markup(self._held.take_all()))
        if lit.closes_key:
            self._key_closer = token
        if lit.ends_args:
            self._close_arguments(token, out)
            self._end_call()

    def _hold_or_drop(self, token: int, text: str, out: list[Event]) -> None:
        if self._committed and not self._pending_name:
            out.append(dropped(token, text, Channel.TOOL_CALL))
        else:
            self._held.append(token, text)

    # -- breaking and ending

    def _break(self, token: int, out: list[Event], *, at_end: bool = False) -> None:
        if not self._committed:
            self._break_uncommitted(out)
            return
        out.extend(self._markup(self._key_run))
        if not at_end:
            self._close_arguments(token, out)
        self._end_call()
        self._literal = ""
        self._state = None
        self._committed = False
        if self._graph.format.at_start:
            self._seen_text = True
        for piece in self._held.take_all():
            self._feed_owned(piece.token, piece.text, out)

    def _break_uncommitted(self, out: list[Event]) -> None:
        """The markup broke before a name was complete: it was ordinary content."""
        self._literal = ""
        self._state = None
        self._reader = None
        self._run = []
        self._pending_name = False
        pieces = self._held.take_all()
        if self._graph.format.at_start:
            self._seen_text = True
            out.extend(_content_or_dropped(pieces))
            return
        if pieces and pieces[0].token != PROMPT_OWNER:
            first = pieces[0]
            out.append(content(first.token, first.text[0]))
            pieces[0] = OwnedText(first.token, first.text[1:])
        for piece in pieces:
            if piece.token == PROMPT_OWNER:
                out.append(dropped(piece.token, piece.text, Channel.TOOL_CALL))
            elif piece.text:
                self._feed_owned(piece.token, piece.text, out)

    def _close_arguments(self, token: int, out: list[Event]) -> None:
        """Built arguments close (a call without any gets ``{}``); JSON ones closed themselves."""
        if self._args_open and self._arguments >= 0:
            out.append(self._argument(token, "}" if self._arguments else "{}"))
        self._args_open = False

    def _end_call(self) -> None:
        self._index = -1
        self._suppressed = False
        self._arguments = 0
        self._args_open = False
        self._pending_name = False
        self._function = None
        self._key_run = []
        self._key_closer = None

    # -- readers

    def _begin_reader(self, reader: Reader, after: State) -> None:
        self._after = after
        self._run = []
        if isinstance(reader, Name):
            self._name_from = self._held.length
        elif isinstance(reader, JsonArguments):
            self._json = JsonExtent()
            self._arguments = -1
        elif isinstance(reader, PythonValue):
            self._python = PythonExtent()
        elif isinstance(reader, Value):
            schema = parameter_schema(self._function, self._key)
            self._value = ValueReader(reader.close, string=self._string_value(), schema=schema)

    def _read(self, token: int, text: str, position: int, out: list[Event]) -> int:
        reader = self._reader
        if isinstance(reader, Name | Index | Key):
            return self._read_run(reader, token, text, position, out)
        if isinstance(reader, JsonArguments):
            end, done = self._json.advance(text, position)
            if end > position:
                out.append(self._argument(token, text[position:end]))
            if done:
                self._finish_reader()
            return end
        if isinstance(reader, PythonValue):
            end, done = self._python.advance(text, position)
            if end > position:
                self._run.append(OwnedText(token, text[position:end]))
            if done:
                self._close_python(token, out)
            return end
        assert self._value is not None
        position, done = self._value.read(token, text, position, self._argument, out)
        if done:
            self._value = None
            self._finish_reader()
        return position

    def _finish_reader(self) -> None:
        self._reader = None
        self._run = []
        self._enter(self._after)

    def _read_run(
        self, reader: Name | Index | Key, token: int, text: str, position: int, out: list[Event]
    ) -> int:
        end = position
        while end < len(text) and self._run_char(reader, text[end]):
            end += 1
        if end > position:
            self._run.append(OwnedText(token, text[position:end]))
            if not isinstance(reader, Key):
                self._held.append(token, text[position:end])
        if end == len(text):
            return end
        if not self._run:
            self._reader = None
            self._break(token, out)
            return end
        if isinstance(reader, Name):
            self._name = "".join(piece.text for piece in self._run)
            self._name_to = self._held.length
            self._pending_name = True  # reported when the markup after it holds
            self._call_index = None
        elif isinstance(reader, Index):
            self._call_index = "".join(piece.text for piece in self._run)
        else:
            self._open_parameter()
        self._finish_reader()
        return end

    def _run_char(self, reader: Name | Index | Key, char: str) -> bool:
        if isinstance(reader, Name):
            return self._graph.name_chars.match(char) is not None
        if isinstance(reader, Index):
            return char.isdigit()
        return _is_key_char(char, python=reader.python)

    def _commit(self, out: list[Event]) -> None:
        """The call is known: the held markup before its name is dropped, the name reported."""
        out.extend(self._markup(self._held.take(self._name_from)))
        name = self._held.take(self._name_to - self._name_from)
        rest = self._held.take_all()
        self._committed = True
        self._pending_name = False
        self._function = self._tools.get(self._name)
        self._arguments = 0
        self._args_open = True
        self._suppressed = not self._parallel and self._reported > 0
        if self._suppressed:
            self._index = -1
            out.extend(self._markup(name + rest))
            return
        self._index = self._reported
        self._reported += 1
        spans = tuple(
            Span(piece.token, piece.text, Channel.TOOL_CALL, tool_index=self._index)
            for piece in name
        )
        template = self._graph.format.call_id
        call_id = (
            None if template is None else template.format(name=self._name, index=self._call_index)
        )
        out.append(ToolCallOpened(self._index, spans, call_id=call_id))
        out.extend(self._markup(rest))

    def _open_parameter(self) -> None:
        """A key is complete: it waits for its closing literal and its value."""
        self._key_run = self._run
        self._key = "".join(piece.text for piece in self._key_run)
        self._python_key = isinstance(self._reader, Key) and self._reader.python
        self._key_closer = None

    def _open_value(self, out: list[Event]) -> None:
        """A value starts: its key goes out, ``{"KEY": `` (or ``, "KEY": ``,
        and ``"`` after it for a string), the colon owned by the key's
        closing literal."""
        pieces = self._key_run
        if not pieces or self._key_closer is None:
            return
        opening = "{" if self._arguments <= 0 else ", "
        self._arguments = max(self._arguments, 0) + 1
        out.append(self._argument(pieces[0].token, opening + '"'))
        out.extend(self._argument(piece.token, json_escape(piece.text)) for piece in pieces)
        out.append(self._argument(self._key_closer, '": "' if self._string_value() else '": '))
        self._key_run = []
        self._key_closer = None

    def _string_value(self) -> bool:
        """Whether the current parameter's value is written as raw text of a string."""
        return not self._python_key and is_string_parameter(self._function, self._key)

    def _close_python(self, token: int, out: list[Event]) -> None:
        pieces = self._run
        text = "".join(piece.text for piece in pieces)
        value = python_json(text, parameter_schema(self._function, self._key))
        first = pieces[0].token if pieces else token
        out.append(self._argument(first, value))
        out.extend(self._markup(pieces[1:] if pieces else []))
        self._finish_reader()

    def _flush_reader(self, out: list[Event]) -> None:
        """The reply ends inside a reader: what it holds goes out as it is."""
        if self._value is not None:
            self._value.flush(self._argument, out)
            self._value = None
        elif isinstance(self._reader, PythonValue):
            out.extend(self._argument(piece.token, piece.text) for piece in self._run)
        elif isinstance(self._reader, Key):
            out.extend(self._markup(self._run))
        self._reader = None
        self._run = []

    # -- output

    def _argument(self, token: int, text: str) -> Span:
        if self._suppressed:
            return dropped(token, text, Channel.TOOL_CALL)
        return Span(token, text, Channel.TOOL_CALL, tool_index=self._index)

    def _markup(self, pieces: list[OwnedText]) -> list[Span]:
        return spans_of(pieces, Channel.DROPPED, Channel.TOOL_CALL)


def _is_key_char(char: str, *, python: bool) -> bool:
    if python:
        return char.isalnum() or char == "_"
    return char not in '<>"=' and not char.isspace()


def _content_or_dropped(pieces: Sequence[OwnedText]) -> list[Span]:
    # Prompt text (from prime) is never output.
    return [
        dropped(piece.token, piece.text, Channel.TOOL_CALL)
        if piece.token == PROMPT_OWNER
        else content(piece.token, piece.text)
        for piece in pieces
        if piece.text
    ]
