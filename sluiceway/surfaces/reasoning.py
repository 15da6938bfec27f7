"""What chat-like surfaces share about reasoning, in neutral terms: an effort
level onto the template's thinking switch, and leaving earlier reasoning out
of the history a client passes back.

Templates have one switch (``enable_thinking``): thinking is on or off. An
API's effort levels (Anthropic's ``output_config.effort``, OpenAI's
``reasoning.effort``) map onto it by one rule, so every surface turns
thinking off at the same levels.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import replace

from sluiceway.surfaces.conversation import Message, Role


class Effort(enum.Enum):
    """How much a client wants the model to think, lowest first."""

    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"
    MAX = "max"


#: Effort levels at which a template with an on/off switch does not think:
#: the switch cannot think a little, and these levels ask for the least.
THINKING_OFF = frozenset({Effort.NONE, Effort.MINIMAL, Effort.LOW})


def thinking_for_effort(effort: Effort) -> bool:
    """The thinking switch for an effort level."""
    return effort not in THINKING_OFF


#: The reasoning level a template reads (``reasoning_effort``, gpt-oss's
#: ``Reasoning: low|medium|high``) for each effort.
_LEVELS = {
    Effort.NONE: "low",
    Effort.MINIMAL: "low",
    Effort.LOW: "low",
    Effort.MEDIUM: "medium",
    Effort.HIGH: "high",
    Effort.XHIGH: "high",
    Effort.MAX: "high",
}


def reasoning_level(effort: str | None) -> str | None:
    """The template's reasoning level for an API's effort (None: not given,
    or a level no API defines)."""
    try:
        return None if effort is None else _LEVELS[Effort(effort)]
    except ValueError:
        return None


def keep_recent_reasoning(messages: Sequence[Message], turns: int) -> tuple[Message, ...]:
    """The history with the reasoning of all but the last ``turns`` assistant
    turns left out (a client's request to clear earlier thinking)."""
    assistants = [i for i, message in enumerate(messages) if message.role is Role.ASSISTANT]
    cleared = set(itertools.islice(assistants, max(len(assistants) - turns, 0)))
    return tuple(
        replace(message, reasoning="") if i in cleared and message.reasoning else message
        for i, message in enumerate(messages)
    )
