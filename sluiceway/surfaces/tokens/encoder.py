"""The generate encoder: output events to ``generate.chunk`` SSE frames, or to
one ``generate`` body. Both shapes come from the same deltas: each carries
the ids of one step of one choice and, when asked, exactly their entries.

A logprob entry's ``token`` is always ``token_id:N`` here (vLLM's spelling on
this endpoint): the path has no text, and the exact bytes are in ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluiceway.protocol.messages import (
    ChoiceDelta,
    Completed,
    Deltas,
    EmitterEvent,
    Failed,
    FinishCause,
    LogprobEntry,
    PromptLogprobs,
    Usage,
)
from sluiceway.surfaces.sse import comment, sse
from sluiceway.surfaces.tokens.errors import error_frame
from sluiceway.surfaces.tokens.wire import (
    ChoiceLogprobsWire,
    GenerateChoiceWire,
    GenerateChunk,
    GenerateChunkChoiceWire,
    GenerateReply,
    PromptLogprobWire,
    PromptTokensDetailsWire,
    TokenLogprobWire,
    TopLogprobWire,
    UsageWire,
)
from sluiceway.surfaces.tokens.wire import PromptLogprobs as PromptLogprobsWire

DONE = b"data: [DONE]\n\n"
KEEPALIVE = comment("keepalive")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateReplyConfig:
    #: The reply's ``id`` (the client's ``request_id``, else the server's).
    reply_id: str
    created: int
    model: str
    n: int
    logprobs: bool
    prompt_logprobs: bool = False
    include_usage: bool = False


def finish_reason(cause: FinishCause | None) -> str | None:
    """vLLM's spelling: ``length`` when ``max_tokens`` ran out, ``abort`` when
    the server cut the choice off (shutting down), else ``stop``."""
    if cause is None:
        return None
    if cause is FinishCause.MAX_TOKENS:
        return "length"
    return "abort" if cause is FinishCause.CANCELLED else "stop"


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def entry_wire(entry: LogprobEntry) -> TokenLogprobWire:
    wire = TokenLogprobWire(
        token=token_name(entry.token_id),
        logprob=entry.logprob,
        bytes=list(entry.bytes),
        top_logprobs=[
            TopLogprobWire(
                token=token_name(top.token_id), logprob=top.logprob, bytes=list(top.bytes)
            )
            for top in entry.top_logprobs
        ],
    )
    if entry.requested:
        wire.token_id_logprobs = {str(t): v for t, v in entry.requested}
    return wire


def prompt_logprobs_wire(event: PromptLogprobs) -> PromptLogprobsWire:
    """vLLM's shape: per position, the prompt token's logprob and rank first,
    then the top alternatives (ranked 1, 2, ...) that are not that token."""
    positions: PromptLogprobsWire = []
    for entry in event.entries:
        if entry is None:
            positions.append(None)
            continue
        scored = {
            str(entry.token_id): PromptLogprobWire(
                logprob=entry.logprob, rank=entry.rank, decoded_token=entry.token
            )
        }
        for rank, top in enumerate(entry.top_logprobs, start=1):
            scored.setdefault(
                str(top.token_id),
                PromptLogprobWire(logprob=top.logprob, rank=rank, decoded_token=top.token),
            )
        positions.append(scored)
    return positions


def usage_wire(usage: Usage) -> UsageWire:
    return UsageWire(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetailsWire(cached_tokens=usage.cached_tokens),
    )


def _logprobs(delta: ChoiceDelta) -> ChoiceLogprobsWire | None:
    if delta.logprobs is None:
        return None
    return ChoiceLogprobsWire(content=[entry_wire(e) for e in delta.logprobs.content])


class GenerateStreamEncoder:
    """Events of one request -> ``generate.chunk`` SSE frames, one per delta."""

    def __init__(self, config: GenerateReplyConfig) -> None:
        self._config = config
        self._prompt_logprobs: PromptLogprobsWire | None = None
        # Most frames carry only ids: a template around the index and the ids
        # is several times cheaper than building and dumping the models.
        bare = self._chunk(
            [GenerateChunkChoiceWire(index=0, token_ids=[], logprobs=None, finish_reason=None)]
        )
        head, _, self._tail = bare.partition(b'{"index":0,"token_ids":[')
        self._head = head + b'{"index":'

    def _chunk(
        self, choices: list[GenerateChunkChoiceWire], usage: UsageWire | None = None
    ) -> bytes:
        config = self._config
        chunk = GenerateChunk(
            id=config.reply_id,
            request_id=config.reply_id,
            created=config.created,
            model=config.model,
            choices=choices,
        )
        if config.include_usage:
            chunk.usage = usage
        if self._prompt_logprobs is not None and choices:
            chunk.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        return sse(chunk.to_json())

    def start(self) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def encode(self, event: EmitterEvent) -> bytes:
        if isinstance(event, Deltas):
            return b"".join(self._frame(delta) for delta in event.deltas)
        if isinstance(event, Completed):
            tail = b""
            if self._config.include_usage:
                tail = self._chunk([], usage_wire(event.usage))
            return tail + DONE
        if isinstance(event, Failed):
            return error_frame(event.message) + DONE
        if isinstance(event, PromptLogprobs) and self._config.prompt_logprobs:
            # Travels on the next chunk that carries a choice.
            self._prompt_logprobs = prompt_logprobs_wire(event)
        return b""

    def _frame(self, delta: ChoiceDelta) -> bytes:
        if delta.logprobs is None and delta.finish is None and self._prompt_logprobs is None:
            ids = ",".join(map(str, delta.token_ids)).encode()
            index = str(delta.index).encode()
            return self._head + index + b',"token_ids":[' + ids + self._tail
        choice = GenerateChunkChoiceWire(
            index=delta.index,
            token_ids=list(delta.token_ids),
            logprobs=_logprobs(delta),
            finish_reason=finish_reason(delta.finish),
        )
        if delta.finish is not None:
            choice.matched_stop = delta.matched_stop
        return self._chunk([choice])


@dataclass(slots=True)
class _ChoiceTotals:
    token_ids: list[int] = field(default_factory=list)
    entries: list[TokenLogprobWire] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: str | int | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.entries += (entry_wire(e) for e in delta.logprobs.content)
        reason = finish_reason(delta.finish)
        if reason is not None:
            self.finish_reason, self.matched_stop = reason, delta.matched_stop


class GenerateAccumulator:
    """Events of one request -> one ``generate`` body (non-streaming)."""

    def __init__(self, config: GenerateReplyConfig) -> None:
        self._config = config
        self._choices = [_ChoiceTotals() for _ in range(config.n)]
        self._usage: Usage | None = None
        self._prompt_logprobs: PromptLogprobsWire | None = None
        self.failure: str | None = None

    def add(self, event: EmitterEvent) -> None:
        if isinstance(event, Deltas):
            for delta in event.deltas:
                self._choices[delta.index].add(delta)
        elif isinstance(event, Completed):
            self._usage = event.usage
        elif isinstance(event, Failed):
            self.failure = event.message
        elif isinstance(event, PromptLogprobs) and self._config.prompt_logprobs:
            self._prompt_logprobs = prompt_logprobs_wire(event)

    def to_json(self) -> str:
        return self.build().to_json()

    def build(self) -> GenerateReply:
        assert self._usage is not None, "build() before the request completed"
        config = self._config
        return GenerateReply(
            id=config.reply_id,
            request_id=config.reply_id,
            created=config.created,
            model=config.model,
            choices=[
                GenerateChoiceWire(
                    index=index,
                    token_ids=totals.token_ids,
                    logprobs=ChoiceLogprobsWire(content=totals.entries)
                    if config.logprobs
                    else None,
                    finish_reason=totals.finish_reason,
                    matched_stop=totals.matched_stop,
                )
                for index, totals in enumerate(self._choices)
            ],
            usage=usage_wire(self._usage),
            prompt_logprobs=self._prompt_logprobs,
        )
