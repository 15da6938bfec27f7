"""Finding fixed markers (tags, stop strings) in a stream of owned text.

Theory of operation: an Aho-Corasick automaton over the marker strings. Its
state after each character is the longest suffix of the text so far that is a
prefix of some marker, so the scanner holds back exactly that suffix -- nothing
that can no longer become a marker -- and every character is examined once
(O(1) amortized per character, never a rescan). While nothing is held, runs of
text that contain no marker's first character are released in one slice.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

_ROOT = 0
#: The automaton state before any character (nothing that could be a marker).
INITIAL_STATE = _ROOT


class MarkerSet:
    """An immutable automaton over a set of non-empty marker strings."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers: tuple[str, ...] = tuple(dict.fromkeys(markers))
        if not self.markers or any(not marker for marker in self.markers):
            raise ValueError("markers must be a non-empty collection of non-empty strings")
        self._goto: list[dict[str, int]] = [{}]
        self._depth: list[int] = [0]
        self._terminal: list[str | None] = [None]
        for marker in self.markers:
            self._insert(marker)
        self._fail: list[int] = [_ROOT] * len(self._goto)
        self._output: list[str | None] = list(self._terminal)
        self._live: list[int] = [0] * len(self._goto)
        self._link_failures()
        first_chars = "".join(sorted({marker[0] for marker in self.markers}))
        self._first_char = re.compile("[" + re.escape(first_chars) + "]")
        self.longest = max(len(marker) for marker in self.markers)

    def _insert(self, marker: str) -> None:
        state = _ROOT
        for char in marker:
            nxt = self._goto[state].get(char)
            if nxt is None:
                nxt = len(self._goto)
                self._goto.append({})
                self._depth.append(self._depth[state] + 1)
                self._terminal.append(None)
                self._goto[state][char] = nxt
            state = nxt
        self._terminal[state] = marker

    def _link_failures(self) -> None:
        queue: deque[int] = deque(self._goto[_ROOT].values())
        for state in queue:
            self._live[state] = 1 if self._goto[state] else 0
        while queue:
            state = queue.popleft()
            for char, child in self._goto[state].items():
                queue.append(child)
                fallback = self._fail[state]
                while fallback != _ROOT and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                target = self._goto[fallback].get(char, _ROOT)
                self._fail[child] = target if target != child else _ROOT
                if self._output[child] is None:
                    self._output[child] = self._output[self._fail[child]]
                # Breadth-first order: the failure state's entry is final already.
                self._live[child] = (
                    self._depth[child] if self._goto[child] else self._live[self._fail[child]]
                )

    def step(self, state: int, char: str) -> int:
        while True:
            nxt = self._goto[state].get(char)
            if nxt is not None:
                return nxt
            if state == _ROOT:
                return _ROOT
            state = self._fail[state]

    def depth(self, state: int) -> int:
        return self._depth[state]

    def live_depth(self, state: int) -> int:
        """Length of the longest suffix at ``state`` that a further character
        could still extend into a marker (a complete marker that no marker
        extends is not live)."""
        return self._live[state]

    def matched(self, state: int) -> str | None:
        """The longest marker that is a suffix of the text at ``state``."""
        return self._output[state]

    def skip_to_candidate(self, text: str, start: int) -> int:
        """Index of the first character at or after ``start`` that begins a marker."""
        found = self._first_char.search(text, start)
        return len(text) if found is None else found.start()


@dataclass(frozen=True, slots=True)
class OwnedText:
    token: int
    text: str


@dataclass(frozen=True, slots=True)
class MarkerFound:
    marker: str
    pieces: tuple[OwnedText, ...]


ScanEvent = OwnedText | MarkerFound


class HeldText:
    """Text held back, remembered piece by piece with its owners.

    Appending is O(1) (pieces are only merged when they are taken), so holding
    a long run one character at a time stays linear.
    """

    def __init__(self) -> None:
        self._pieces: deque[OwnedText] = deque()
        self.length = 0

    def __bool__(self) -> bool:
        return self.length > 0

    @property
    def first_owner(self) -> int | None:
        return self._pieces[0].token if self._pieces else None

    def first_owner_at_least(self, floor: int) -> int | None:
        """The first owner not below ``floor`` (owners never decrease along the text)."""
        for piece in self._pieces:
            if piece.token >= floor:
                return piece.token
        return None

    def append(self, token: int, text: str) -> None:
        if text:
            self._pieces.append(OwnedText(token, text))
            self.length += len(text)

    def take(self, count: int) -> list[OwnedText]:
        """Remove and return the first ``count`` characters, one piece per owner run."""
        taken: list[OwnedText] = []
        run: list[str] = []
        run_token = 0
        while count > 0:
            piece = self._pieces[0]
            if len(piece.text) <= count:
                self._pieces.popleft()
                text = piece.text
            else:
                text = piece.text[:count]
                self._pieces[0] = OwnedText(piece.token, piece.text[count:])
            count -= len(text)
            self.length -= len(text)
            if run and piece.token != run_token:
                taken.append(OwnedText(run_token, "".join(run)))
                run = []
            run_token = piece.token
            run.append(text)
        if run:
            taken.append(OwnedText(run_token, "".join(run)))
        return taken

    def take_all(self) -> list[OwnedText]:
        return self.take(self.length)


class MarkerScanner:
    """Splits owned text into plain runs and whole markers, holding back only
    a suffix that may still turn into a marker.

    A found marker resets the automaton: markers (tags) do not overlap.
    """

    def __init__(self, markers: MarkerSet) -> None:
        self._markers = markers
        self._state = _ROOT
        self._held = HeldText()

    @property
    def held_from(self) -> int | None:
        return self._held.first_owner

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def feed(self, token: int, text: str) -> list[ScanEvent]:
        events: list[ScanEvent] = []
        position = 0
        while position < len(text):
            found, position = self.scan(token, text, position)
            events.extend(found)
        return events

    def scan(self, token: int, text: str, start: int = 0) -> tuple[list[ScanEvent], int]:
        """Like :meth:`feed` from ``start``, but stop right after the first
        marker found: returns the events and the position reached. A caller
        whose grammar changes at a marker reads the rest with other rules."""
        events: list[ScanEvent] = []
        markers = self._markers
        position = start
        while position < len(text):
            if self._state == _ROOT:
                candidate = markers.skip_to_candidate(text, position)
                if candidate > position:
                    events.append(OwnedText(token, text[position:candidate]))
                position = candidate
                if position == len(text):
                    break
            char = text[position]
            position += 1
            self._held.append(token, char)
            self._state = markers.step(self._state, char)
            found = markers.matched(self._state)
            if found is not None:
                self._emit_released(events, self._held.length - len(found))
                events.append(MarkerFound(found, tuple(self._held.take_all())))
                self._state = _ROOT
                break
            self._emit_released(events, self._held.length - markers.depth(self._state))
        return events, position

    def finish(self) -> list[OwnedText]:
        """Release everything held (no marker can complete any more) and reset."""
        self._state = _ROOT
        return self._held.take_all()

    def _emit_released(self, events: list[ScanEvent], count: int) -> None:
        if count > 0:
            events.extend(self._held.take(count))
