"""A format's description compiled into the graph its parser walks.

A node is a place between parts; its *options* are what may come next: fixed
literals (each leading to a node), at most one reader (a name, a key, a
value, JSON arguments...), and the end of the markup. ``Opt``, ``Choice`` and
``Repeat`` become empty edges, closed over when the graph is built, so the
parser only ever sees the options of a node. The parser decides between
options by the next character, so the graph is checked to be deterministic:
no literal of a node is a prefix of another, no node has two readers, and a
reader's first character never starts a literal beside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

from sluiceway.parsers.formats.spec import (
    Choice,
    Lit,
    Opt,
    Part,
    PythonArguments,
    Reader,
    Repeat,
    Seq,
    Tagged,
    ToolFormat,
)


@dataclass(eq=False)
class Node:
    """A place in the markup; edges are filled in while compiling."""

    literals: list[tuple[Lit, Node]] = field(default_factory=list)
    readers: list[tuple[Reader, Node]] = field(default_factory=list)
    empty: list[Node] = field(default_factory=list)
    is_end: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class Options:
    """What may come next at a node, empty edges followed."""

    literals: tuple[tuple[Lit, State], ...]
    reader: tuple[Reader, State] | None
    end: bool

    @property
    def end_only(self) -> bool:
        return self.end and not self.literals and self.reader is None

    @property
    def whitespace(self) -> bool:
        """Whether whitespace may come here (before a literal, a reader or the end)."""
        reader_ws = self.reader is not None and self.reader[0].ws
        return self.end or reader_ws or any(not lit.tight for lit, _ in self.literals)


@dataclass(eq=False)
class State:
    """A node as the parser sees it: its options, computed once."""

    node: Node
    graph: Graph

    @cached_property
    def options(self) -> Options:
        return self.graph.options(self.node)


class Graph:
    """The compiled graph of one format."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.format = fmt
        end = Node(is_end=True)
        self.start = State(_compile(fmt.body, end), self)
        self._states: dict[int, State] = {}
        self.name_chars = re.compile(fmt.name_chars + "+")
        self._check()

    def state(self, node: Node) -> State:
        found = self._states.get(id(node))
        if found is None:
            found = self._states[id(node)] = State(node, self)
        return found

    def options(self, node: Node) -> Options:
        literals: list[tuple[Lit, State]] = []
        readers: list[tuple[Reader, State]] = []
        end = False
        for reached in _closure(node):
            literals += [(lit, self.state(target)) for lit, target in reached.literals]
            readers += [(reader, self.state(target)) for reader, target in reached.readers]
            end = end or reached.is_end
        if len(readers) > 1:
            raise ValueError(f"{self.format.name}: two readers at one place")
        return Options(tuple(literals), readers[0] if readers else None, end)

    @property
    def entry(self) -> tuple[tuple[Lit, State], ...]:
        """The literals that open the markup."""
        options = self.start.options
        if options.reader is not None or options.end or not options.literals:
            raise ValueError(f"{self.format.name}: the markup must open with a literal")
        return options.literals

    def _check(self) -> None:
        for state in self._walk():
            texts = [lit.text for lit, _ in state.options.literals]
            for a in texts:
                if any(b != a and b.startswith(a) for b in texts):
                    raise ValueError(f"{self.format.name}: {a!r} is a prefix of a sibling")

    def _walk(self) -> Iterator[State]:
        seen: set[int] = set()
        todo = [self.start]
        while todo:
            state = todo.pop()
            if id(state) in seen:
                continue
            seen.add(id(state))
            yield state
            options = state.options
            todo += [target for _, target in options.literals]
            if options.reader is not None:
                todo.append(options.reader[1])


def _closure(node: Node) -> list[Node]:
    seen: dict[int, Node] = {}
    todo = [node]
    while todo:
        current = todo.pop()
        if id(current) not in seen:
            seen[id(current)] = current
            todo += current.empty
    return list(seen.values())


def _compile(part: Part, follow: Node) -> Node:
    """The node where ``part`` starts, given the node that follows it."""
    if isinstance(part, Lit):
        return Node(literals=[(part, follow)])
    if isinstance(part, Seq):
        node = follow
        for inner in reversed(part.parts):
            node = _compile(inner, node)
        return node
    if isinstance(part, Choice):
        return Node(empty=[_compile(option, follow) for option in part.options])
    if isinstance(part, Opt):
        return Node(empty=[_compile(part.part, follow), follow])
    if isinstance(part, Repeat):
        loop = Node()
        loop.empty = [_compile(part.part, loop), follow]
        return loop
    if isinstance(part, Tagged | PythonArguments):
        return _compile(part.part(), follow)
    return Node(readers=[(part, follow)])
