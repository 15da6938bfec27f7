"""The token path of the output actor: ids out as they come, no text.

The tokens surface (``/inference/v1/generate``) returns token ids, not text.
So a choice here sends each id, with its logprob entry, in the delta of the
step that produced it: nothing is detokenized or parsed, nothing waits. Only
when the request has stop strings is each token also fed to a text path that
does nothing but match them (``ChoicePipeline`` with the stop stage alone).
Even then no id waits for the matcher: the ids of a stop string's tokens are
generated tokens and stay in the reply (as vLLM returns them), so the matcher
only decides where the choice ends, which it knows in the step of the token
that completes the match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    FinishCause,
    LogprobEntry,
    TokenLogprob,
    TokenSample,
)


@dataclass(slots=True, kw_only=True)
class TokenChoiceOutput:
    """One choice of the token path (a ``ChoiceCore`` of the output actor)."""

    index: int
    #: Matches the request's stop strings (None: it has none).
    stops: ChoicePipeline | None
    #: Makes a token's logprob entry (None: the request asked for none).
    entry: Callable[[int, TokenLogprob], LogprobEntry] | None
    #: Whether a stop token id's text counts for stop strings (as on completions).
    include_stop_token_text: bool = False
    finished: bool = False
    tokens_fed: int = 0
    #: No text, so no reasoning: kept for the usage every choice reports.
    reasoning_tokens: int = 0

    def take(self, sample: TokenSample) -> tuple[list[ChoiceDelta], bool]:
        """Feed one token; returns its delta and whether a stop string ended the choice."""
        if self.finished:
            return [], False  # generated after a stop string ended the choice
        self.tokens_fed += 1
        logprobs = None
        if self.entry is not None and sample.logprob is not None:
            logprobs = ChoiceLogprobs(content=(self.entry(sample.token_id, sample.logprob),))
        cause = sample.finish
        matched: str | int | None = sample.token_id if cause is FinishCause.STOP_TOKEN else None
        stopped = False
        if self.stops is not None:
            hidden = cause is FinishCause.EOS or (
                cause is FinishCause.STOP_TOKEN and not self.include_stop_token_text
            )
            self.stops.feed(sample.token_id, visible=not hidden)
            if self.stops.stopped_by is not None:
                cause, matched, stopped = FinishCause.STOP_STRING, self.stops.stopped_by, True
            elif cause is not None:
                cause, matched = self._conclude(cause, matched)
        self.finished = cause is not None
        delta = ChoiceDelta(
            index=self.index,
            token_ids=(sample.token_id,),
            logprobs=logprobs,
            finish=cause,
            matched_stop=matched,
        )
        return [delta], stopped

    def abandon(self) -> list[ChoiceDelta]:
        """The scheduler ended the request without finishing this choice."""
        if self.finished:
            return []
        self.finished = True
        cause, matched = self._conclude(FinishCause.CANCELLED, None)
        return [ChoiceDelta(index=self.index, finish=cause, matched_stop=matched)]

    def _conclude(
        self, cause: FinishCause, matched: str | int | None
    ) -> tuple[FinishCause, str | int | None]:
        """The output ends here: a stop string still pending decides the cause
        (a shorter stop string wins only at the end, once no longer,
        earlier-starting one can still match), as on the text path."""
        if self.stops is not None:
            self.stops.finish()
            if self.stops.stopped_by is not None:
                return FinishCause.STOP_STRING, self.stops.stopped_by
        return cause, matched
