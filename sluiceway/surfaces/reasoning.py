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


def keep_recent_reasoning(messages: Sequence[Message], turns: int) -> tuple[Message, ...]:
    """The history with the reasoning of all but the last ``turns`` assistant
    turns left out (a client's request to clear earlier thinking)."""
    assistants = [i for i, message in enumerate(messages) if message.role is Role.ASSISTANT]
    cleared = set(itertools.islice(assistants, max(len(assistants) - turns, 0)))
    return tuple(
        replace(message, reasoning="") if i in cleared and message.reasoning else message
        for i, message in enumerate(messages)
    )
