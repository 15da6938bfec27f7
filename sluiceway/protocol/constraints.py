"""What a request constrains its output to, in neutral terms.

A surface translates its own spelling (``response_format``, ``structured_outputs``,
a strict tool) into a :class:`Constraint`; the grammar engine compiles it and
the sampler masks each constrained row's logits with it.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass


class ConstraintKind(enum.Enum):
    """The language a constraint's text is written in."""

    #: A JSON Schema document (JSON text).
    JSON_SCHEMA = "json_schema"
    #: Any JSON object; the text is ignored.
    JSON_OBJECT = "json_object"
    #: A regular expression the whole output matches.
    REGEX = "regex"
    #: One of several literal strings, given as a JSON array of strings.
    CHOICE = "choice"
    #: A context-free grammar in Lark syntax.
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningGate:
    """The free-text reasoning section a constraint waits out.

    The constraint applies from the token after ``end_id`` (``</think>``).
    ``inside``: the prompt left the output inside reasoning. Otherwise, when
    ``start_id`` is set, the output may open reasoning with that token
    (``<think>``) as its first one; any other first token starts the
    constrained text at once.
    """

    end_id: int
    start_id: int | None = None
    inside: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraint:
    """What the output after any reasoning must match."""

    kind: ConstraintKind
    text: str = ""
    reasoning: ReasoningGate | None = None

    @property
    def key(self) -> tuple[ConstraintKind, str]:
        """What identifies the compiled grammar (the gate does not change it)."""
        return (self.kind, self.text)

    @classmethod
    def choice(
        cls, options: Iterable[str], *, reasoning: ReasoningGate | None = None
    ) -> Constraint:
        """A :attr:`ConstraintKind.CHOICE` among ``options``."""
        return cls(kind=ConstraintKind.CHOICE, text=json.dumps(list(options)), reasoning=reasoning)
