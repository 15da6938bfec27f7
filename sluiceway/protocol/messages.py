"""Messages the actors exchange: frozen, slotted, keyword-only dataclasses.

Each channel has one union alias (``SchedulerCommand``, ``RequestOutput``,
``EmitterEvent``) so an actor's ``async for`` loop matches on a closed set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from sluiceway.protocol.constraints import Constraint
from sluiceway.protocol.tokens import TokenTable

# Actor messages carry engine arrays (NumPy float32) without copying them.
Array = Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one choice picks its next token; ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobParams:
    """What logprobs one request asked for. ``top is None``: none at all."""

    top: int | None = None
    token_ids: tuple[int, ...] = ()
    prompt_top: int | None = None

    @property
    def per_token(self) -> bool:
        return self.top is not None or bool(self.token_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Token-level ends of generation, enforced by the scheduler."""

    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


class FinishCause(enum.Enum):
    """Why a choice ended; each surface's encoder spells it (a finish or stop
    reason, a status)."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    #: The request ended before the choice did (the scheduler cut it off).
    CANCELLED = "cancelled"
    #: The constraint's grammar is complete and admits no further token.
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """A validated request, as the scheduler sees it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: LogprobParams = field(default_factory=LogprobParams)
    limits: Limits
    #: What every choice's output must match (compiled by the grammar engine).
    constraint: Constraint | None = None


# --- server -> scheduler ---------------------------------------------------


T_contra = TypeVar("T_contra", contravariant=True)


class Outbox(Protocol[T_contra]):
    """Where the scheduler puts one request's messages without waiting (a
    mailbox's writer, or a memory object stream's send half)."""

    def send_nowait(self, message: T_contra) -> None: ...

    def close(self) -> None: ...


class Backlog(Protocol):
    """How far a request's reader is behind (a mailbox with a limit)."""

    @property
    def full(self) -> bool:
        """The reader is too far behind: the request's rows should wait."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Submit:
    request: GenerationRequest
    output: Outbox[RequestOutput]
    #: The output's fill level, when its reader may fall behind; a full
    #: backlog pauses the request's rows (a :class:`Resume` wakes them).
    backlog: Backlog | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishChoice:
    """The output actor ended a choice (a stop string matched)."""

    request_id: str
    choice: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """A paused request's reader has caught up."""

    request_id: str


SchedulerCommand = Submit | Cancel | FinishChoice | Resume


# --- scheduler <-> sampler <-> reducer -------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One batch row: a choice of a request, with what sampling needs of it."""

    request_id: str
    choice: int
    sampling: SamplingParams
    logprobs: LogprobParams
    prompt_ids: tuple[int, ...]
    first: bool
    #: Ids this row may not pick now (EOS and stop tokens before min_tokens).
    suppress: tuple[int, ...] = ()
    constraint: Constraint | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.choice)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to adjust and no logprobs: an argmax."""
        return is_argmax(self.sampling, self.logprobs, self.constraint) and not self.suppress

    @property
    def unadjusted(self) -> bool:
        """Its token depends on its logits alone (and, sampled, its one
        random draw): no grammar, bias, penalties or suppressed ids. Such a
        row can be picked where the logits are (``StepPlan.draws``)."""
        return is_unadjusted(self.sampling, self.constraint) and not self.suppress


def is_argmax(
    sampling: SamplingParams, logprobs: LogprobParams, constraint: Constraint | None
) -> bool:
    """Greedy, with no bias, penalties or grammar mask to apply and no
    logprobs to keep. A constrained row is never one: the engine's argmax
    would ignore what the grammar allows (a greedy one takes the argmax
    under a mask the plan carries: ``StepPlan.masks``)."""
    return is_unadjusted(sampling, constraint) and sampling.greedy and not logprobs.per_token


def is_unadjusted(sampling: SamplingParams, constraint: Constraint | None) -> bool:
    """No grammar, bias or penalties: nothing but the logits (and a sampled
    row's random draw) decides the token, before any suppressed ids."""
    return constraint is None and not sampling.logit_bias and not sampling.penalised


@dataclass(frozen=True, slots=True, kw_only=True)
class LogitsStep:
    """One engine step's last-position logits, a row per :class:`Row`;
    ``live``: the keys (``Row.key``) of every choice running beside them,
    whose sampler state must stay."""

    step: int
    rows: tuple[Row, ...]
    logits: Array
    live: frozenset[tuple[str, int]] = frozenset()


class TokenLogprob(NamedTuple):
    """The reduced logprobs of one sampled token (ids, not text).

    A named tuple, not a dataclass like the messages around it: with the
    engine in its child process, a step's rows that ask for logprobs cross
    the pipe as these, and a tuple is built in a quarter of a frozen
    dataclass's time and pickled and read back in under half (16 rows with
    top-5: 37 µs against 85).
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    requested: tuple[tuple[int, float], ...] = ()
    #: The token's 1-based rank in its distribution (prompt logprobs only).
    rank: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstraintReport:
    """What the constrained rows of a step came to, by row index."""

    #: Rows whose grammar is complete after their token: nothing may follow.
    complete: frozenset[int] = frozenset()
    #: Rows the grammar engine failed on, with its message.
    failed: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledStep:
    """Sampled ids for a step; ``logits``/``processed`` travel to the reducer
    only when a row asked for logprobs, and are gone after it."""

    step: int
    rows: tuple[Row, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...] | None = None
    logits: Array | None = None
    processed: Array | None = None
    #: Set when a row of the step has a constraint.
    constraints: ConstraintReport | None = None


# --- scheduler -> per-request output actor ---------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenSample:
    choice: int
    token_id: int
    logprob: TokenLogprob | None
    finish: FinishCause | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutput:
    """A request's tokens from one engine step (one per running choice)."""

    samples: tuple[TokenSample, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptScores:
    """Logprobs of the prompt tokens; the first prompt token has none."""

    entries: tuple[TokenLogprob | None, ...]


class FailureCause(enum.Enum):
    """Why a request ended without finishing; a surface may spell it (an
    error type, a status for a whole reply)."""

    #: The engine failed (an error at a step, its process gone).
    ENGINE = "engine"
    #: The server is shutting down and its grace period is over.
    SHUTDOWN = "shutdown"
    #: The request ran past ``--request-timeout``.
    DEADLINE = "deadline"
    #: The client stopped reading for longer than ``--stall-timeout``.
    STALLED = "stalled"


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptCached:
    """The first ``tokens`` prompt tokens came from the prefix cache (sent
    at admission, only when some did)."""

    tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFailed:
    message: str
    cause: FailureCause = FailureCause.ENGINE


RequestOutput = StepOutput | PromptScores | PromptCached | RequestFailed


# --- output actor -> emitter -------------------------------------------------


class TopLogprob(NamedTuple):
    """One alternative of a logprob entry. A named tuple, not a dataclass like
    the messages around it: a token with top-20 logprobs makes twenty, and a
    tuple is built in a third of a frozen dataclass's time."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobEntry:
    """A token's logprob entry, with its text (``token``: the token's bytes
    as a string) and id; a surface may show the id instead of the text."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...]
    #: What the ids of ``top`` stand for.
    vocabulary: TokenTable = field(repr=False, compare=False)
    #: The best alternatives as (id, logprob), best first. Ids rather than
    #: :class:`TopLogprob`\ s: the JSON encoders look each id's text up in
    #: their own memo (:meth:`TokenTable.memo`), so with top-5 a token would
    #: build five objects that only the pydantic surfaces read.
    top: tuple[tuple[int, float], ...] = ()
    requested: tuple[tuple[int, float], ...] = ()
    #: 1-based rank in the token's distribution, where known (prompt logprobs).
    rank: int | None = None

    @property
    def top_logprobs(self) -> tuple[TopLogprob, ...]:
        """``top`` with each alternative's text and bytes."""
        parts = self.vocabulary.entry_parts
        tops = []
        for token_id, logprob in self.top:
            text, raw = parts(token_id)
            tops.append(TopLogprob(text, token_id, logprob, raw))
        return tuple(tops)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """A fragment of one tool call; the first carries the function ``name``
    (the surface's encoder mints the call's id there)."""

    index: int
    arguments: str
    name: str | None = None
    #: The id the model wrote (first fragment only); None: the encoder mints one.
    call_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceLogprobs:
    content: tuple[LogprobEntry, ...] = ()
    reasoning: tuple[LogprobEntry, ...] = ()
    tool_calls: tuple[LogprobEntry, ...] = ()
    #: Where each content entry's token sits in the delta's content.
    content_offsets: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceDelta:
    """A delta of one choice; ``finish`` is set on the choice's last, with
    whether the choice called tools and what stop (string or token id)
    ended it. Each surface's encoder spells the cause."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: ChoiceLogprobs | None = None
    finish: FinishCause | None = None
    called_tools: bool = False
    matched_stop: str | int | None = None
    #: Generated token ids that ride with this delta (``return_token_ids``,
    #: the tokens surface): over a choice's deltas, every id once, in order.
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    #: Prompt tokens whose KV came from the prefix cache (part of ``prompt_tokens``).
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptLogprobs:
    """Prompt-token entries for ``echo`` and ``prompt_logprobs``, for the
    choices ``first_index .. first_index + n - 1`` (one prompt's choices)."""

    entries: tuple[LogprobEntry | None, ...]
    first_index: int = 0
    n: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Deltas:
    """One engine step's deltas for one request (possibly several choices)."""

    deltas: tuple[ChoiceDelta, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Completed:
    usage: Usage


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    message: str
    cause: FailureCause = FailureCause.ENGINE


EmitterEvent = Deltas | PromptLogprobs | Completed | Failed
