"""One constrained choice's walk through its grammar, for the sampler (sans-IO).

Theory of operation: a state machine per row, advanced by the token the row
sampled.

- ``REASONING``: inside a free reasoning section (the prompt left it open, or
  the row opened it). Any token but EOS may follow; the gate's end token
  (``</think>``) moves on to ``GRAMMAR``.
- ``OPENING``: the row's first token, when the output may open reasoning
  itself: the grammar's first tokens or the gate's start token (``<think>``,
  which leads to ``REASONING``).
- ``GRAMMAR``: the grammar's matcher decides; EOS only where it accepts. A
  token after which the grammar admits nothing more makes the row
  ``COMPLETE``.
- ``FAILED``: the grammar did not compile, or the engine gave up on it (a
  resource limit); the row's request fails with the engine's message.

A mask is computed once per token and kept until the row's next token; the
sampler computes the next one while the engine runs the next forward pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import llguidance
import numpy as np
import numpy.typing as npt

from sluiceway.engines.grammar import Bitmask, allow, every_token, mask_logits
from sluiceway.protocol.constraints import ReasoningGate

FloatArray = npt.NDArray[np.float32]


class GuideState(enum.Enum):
    REASONING = "reasoning"
    OPENING = "opening"
    GRAMMAR = "grammar"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(slots=True)
class RowGuide:
    """The constraint of one running choice."""

    matcher: llguidance.LLMatcher | None
    gate: ReasoningGate | None
    eos_ids: tuple[int, ...]
    state: GuideState = GuideState.GRAMMAR
    error: str = ""
    #: The mask for the row's next token, once computed.
    mask: Bitmask | None = None

    @classmethod
    def start(
        cls, matcher: llguidance.LLMatcher, gate: ReasoningGate | None, eos_ids: tuple[int, ...]
    ) -> RowGuide:
        guide = cls(matcher, gate, eos_ids)
        if gate is not None and gate.inside:
            guide.state = GuideState.REASONING
        elif gate is not None and gate.start_id is not None:
            guide.state = GuideState.OPENING
        return guide

    @classmethod
    def failed(cls, error: str) -> RowGuide:
        return cls(None, None, (), GuideState.FAILED, error)

    def wants_mask(self) -> llguidance.LLMatcher | None:
        """The matcher whose mask the next token needs, if not computed yet."""
        if self.mask is None and self.state in (GuideState.OPENING, GuideState.GRAMMAR):
            return self.matcher
        return None

    def take_mask(self, mask: Bitmask) -> None:
        assert self.matcher is not None
        if self.matcher.is_error():
            self._fail(self.matcher.get_error())
        elif not mask.any():
            self._fail("the grammar allows no token here")
        else:
            self.mask = mask

    def apply(self, x: FloatArray) -> None:
        """Disallow, in place, every token this row may not pick next."""
        if self.state is GuideState.REASONING:
            x[list(self.eos_ids)] = -np.inf
            return
        mask = self.mask
        if mask is None:
            return  # COMPLETE or FAILED: the scheduler ends the row
        if self.state is GuideState.OPENING and self.gate is not None:
            assert self.gate.start_id is not None
            mask = allow(mask, self.gate.start_id)
        mask_logits(x, mask)

    def allowed(self, vocab_size: int) -> Bitmask | None:
        """The tokens :meth:`apply` lets through, as a mask (None: no mask
        computed yet, or the row is COMPLETE or FAILED). The engine applies
        it before its own argmax, in a greedy step."""
        if self.state is GuideState.REASONING:
            return every_token(vocab_size, but=self.eos_ids)
        mask = self.mask
        if mask is not None and self.state is GuideState.OPENING and self.gate is not None:
            assert self.gate.start_id is not None
            return allow(mask, self.gate.start_id)
        return mask

    def advance(self, token: int) -> None:
        """Take the row's sampled token."""
        self.mask = None
        if self.state is GuideState.REASONING:
            if self.gate is not None and token == self.gate.end_id:
                self.state = GuideState.GRAMMAR
            return
        if self.state is GuideState.OPENING:
            if self.gate is not None and token == self.gate.start_id:
                self.state = GuideState.REASONING
                return
            self.state = GuideState.GRAMMAR
        if self.state is not GuideState.GRAMMAR or self.matcher is None:
            return
        if not self.matcher.consume_token(token):
            self._fail(self.matcher.get_error() or f"token {token} is outside the grammar")
        elif self.matcher.is_stopped():
            self.state = GuideState.COMPLETE

    def _fail(self, error: str) -> None:
        self.state = GuideState.FAILED
        self.error = f"the grammar engine failed: {error}"
        self.mask = None
