"""The per-request output actor: token ids in, text deltas with entries out.

For each choice it runs the sans-IO text path (detokenizer -> reasoning ->
stop -> tool calls -> chunk assembler) and turns the assembler's chunks into
:class:`ChoiceDelta` messages, attaching the logprob entry of each token to
the chunk the assembler chose for it (and, when asked, the token's id: see
:meth:`ChoiceOutput._ids_for`). When a stop string ends a choice, it tells the
scheduler so the row leaves the batch; tokens the scheduler produced for that
choice in the meantime are not counted. The tokens surface takes the token
path instead (``sluiceway.actors.token_output``): ids out as they come, no text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from sluiceway.actors.channels import MailboxReader, put
from sluiceway.actors.token_output import TokenChoiceOutput
from sluiceway.parsers.assembler import Chunk
from sluiceway.parsers.events import Channel
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    Completed,
    Deltas,
    EmitterEvent,
    Failed,
    FinishCause,
    LogprobEntry,
    PromptCached,
    PromptLogprobs,
    PromptScores,
    RequestFailed,
    RequestOutput,
    StepOutput,
    TokenLogprob,
    TokenSample,
    ToolCallDelta,
    Usage,
)
from sluiceway.protocol.tokens import TokenTable


class ChoiceFinisher(Protocol):
    def finish_choice(self, request_id: str, choice: int) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputConfig:
    request_id: str
    n: int
    prompt_ids: tuple[int, ...]
    #: Index of this request's first choice in the reply (several prompts of a
    #: legacy completions request share one reply).
    index_offset: int = 0
    table: TokenTable
    make_pipeline: Callable[[], ChoicePipeline]
    logprobs: bool
    #: Keep the text of a stop token id in the output.
    include_stop_token_text: bool = False
    #: Deltas carry their tokens' ids too (``return_token_ids``).
    token_ids: bool = False
    #: The token path: deltas carry ids and entries, no text, each id in the
    #: step that produced it; ``make_pipeline`` then only matches stop strings.
    ids_only: bool = False


class ChoiceCore(Protocol):
    """One choice's output: a sampled token in, its deltas out."""

    def take(self, sample: TokenSample) -> tuple[list[ChoiceDelta], bool]:
        """Feed one token; returns its deltas and whether a stop string ended the choice."""
        ...

    def abandon(self) -> list[ChoiceDelta]:
        """The scheduler ended the request without finishing this choice."""
        ...

    @property
    def tokens_fed(self) -> int:
        """The tokens this choice counts (``usage.completion_tokens``)."""
        ...

    @property
    def reasoning_tokens(self) -> int: ...


class EntryFactory:
    """Turns id-level logprobs into entries with text, id and exact bytes
    (looked up once per id and tokenizer: :meth:`TokenTable.entry_parts`).
    The alternatives stay ids: see :attr:`LogprobEntry.top`."""

    def __init__(self, table: TokenTable) -> None:
        self._table = table
        self._token = table.entry_parts

    def entry(self, token_id: int, logprob: TokenLogprob) -> LogprobEntry:
        token, raw = self._token(token_id)
        return LogprobEntry(
            token=token,
            token_id=token_id,
            logprob=logprob.logprob,
            bytes=raw,
            vocabulary=self._table,
            top=logprob.top,
            requested=logprob.requested,
            rank=logprob.rank,
        )


@dataclass(slots=True)
class ChoiceOutput:
    """One choice's text path and the entries waiting for their chunk."""

    index: int
    pipeline: ChoicePipeline
    entries: EntryFactory
    with_logprobs: bool
    include_stop_token_text: bool
    finished: bool = False
    called_tools: bool = False
    waiting: dict[int, LogprobEntry] = field(default_factory=dict)
    #: ``return_token_ids``: the ids fed, and how many of them went out.
    with_ids: bool = False
    ids: list[int] = field(default_factory=list)
    ids_sent: int = 0

    @property
    def tokens_fed(self) -> int:
        return self.pipeline.tokens_fed

    @property
    def reasoning_tokens(self) -> int:
        return self.pipeline.channel_counts()[Channel.REASONING]

    def take(self, sample: TokenSample) -> tuple[list[ChoiceDelta], bool]:
        """Feed one token; returns its deltas and whether a stop string ended the choice."""
        if self.finished:
            return [], False  # generated after a stop string ended the choice
        if self.with_ids:
            self.ids.append(sample.token_id)
        position = self.pipeline.tokens_fed
        if self.with_logprobs and sample.logprob is not None:
            self.waiting[position] = self.entries.entry(sample.token_id, sample.logprob)
        hidden = sample.finish is FinishCause.EOS or (
            sample.finish is FinishCause.STOP_TOKEN and not self.include_stop_token_text
        )
        deltas = self._deltas(self.pipeline.feed(sample.token_id, visible=not hidden))
        stop_string = self.pipeline.stopped_by
        if stop_string is not None:
            deltas += self._finish(FinishCause.STOP_STRING, stop_string)
            return deltas, True
        if sample.finish is not None:
            matched = sample.token_id if sample.finish is FinishCause.STOP_TOKEN else None
            deltas += self._finish(sample.finish, matched)
        return deltas, False

    def abandon(self) -> list[ChoiceDelta]:
        """The scheduler ended the request without finishing this choice."""
        return [] if self.finished else self._finish(FinishCause.CANCELLED, None)

    def _finish(self, cause: FinishCause, matched: str | int | None) -> list[ChoiceDelta]:
        self.finished = True
        done = self.pipeline.finish()
        if self.pipeline.stopped_by is not None:
            # A shorter stop string can only win when the output ends (a
            # longer, earlier-starting one could still have matched).
            cause, matched = FinishCause.STOP_STRING, self.pipeline.stopped_by
        deltas = self._deltas(done.chunks)
        final = self._delta(done.final)
        deltas.append(
            ChoiceDelta(
                index=self.index,
                logprobs=final.logprobs,
                finish=cause,
                called_tools=self.called_tools,
                matched_stop=matched,
                token_ids=self._ids_up_to(len(self.ids)) if self.with_ids else (),
            )
        )
        return deltas

    def _deltas(self, chunks: list[Chunk] | tuple[Chunk, ...]) -> list[ChoiceDelta]:
        if not self.with_ids:
            return [self._delta(chunk) for chunk in chunks]
        return [self._delta(chunk, self._ids_for(chunk)) for chunk in chunks]

    def _ids_for(self, chunk: Chunk) -> tuple[int, ...]:
        """The ids a chunk carries (the ownership rule of docs/alignment.md):
        every id not sent yet up to the last token whose entry rides with the
        chunk. Those tokens' first characters are in it (or they are markup
        the assembler attached), and ids go out in order, so the markup tokens
        before them come along; the finishing delta takes the rest. So a chunk
        never carries text whose owner's id is still to come, and a markup
        token's id rides with the next chunk that carries a later token's
        first character: the first chunk after the step that decided the
        token had no text carries one, since text still to come belongs to
        later tokens."""
        last = -1
        for tokens in (chunk.reasoning_tokens, chunk.content_tokens, chunk.tool_call_tokens):
            if tokens and tokens[-1] > last:
                last = tokens[-1]
        return self._ids_up_to(last + 1)

    def _ids_up_to(self, end: int) -> tuple[int, ...]:
        if end <= self.ids_sent:
            return ()
        ids = tuple(self.ids[self.ids_sent : end])
        self.ids_sent = end
        return ids

    def _delta(self, chunk: Chunk, token_ids: tuple[int, ...] = ()) -> ChoiceDelta:
        calls: tuple[ToolCallDelta, ...] = ()
        if chunk.tool_calls:
            calls = tuple(
                ToolCallDelta(index=f.index, arguments=f.arguments, name=f.name, call_id=f.call_id)
                for f in chunk.tool_calls
            )
            self.called_tools = True
        return ChoiceDelta(
            index=self.index,
            content=chunk.content,
            reasoning=chunk.reasoning,
            tool_calls=calls,
            logprobs=self._logprobs(chunk) if self.with_logprobs else None,
            token_ids=token_ids,
        )

    def _logprobs(self, chunk: Chunk) -> ChoiceLogprobs:
        """The entries of the tokens whose first characters the chunk carries
        (a token already sent with an earlier chunk has none waiting)."""
        waiting = self.waiting
        entries: list[LogprobEntry] = []
        offsets: list[int] = []
        for token, offset in zip(chunk.content_tokens, chunk.content_offsets, strict=True):
            entry = waiting.pop(token, None)
            if entry is not None:
                entries.append(entry)
                offsets.append(offset)
        return ChoiceLogprobs(
            content=tuple(entries),
            reasoning=self._entries(chunk.reasoning_tokens) if chunk.reasoning_tokens else (),
            tool_calls=self._entries(chunk.tool_call_tokens) if chunk.tool_call_tokens else (),
            content_offsets=tuple(offsets),
        )

    def _entries(self, tokens: tuple[int, ...]) -> tuple[LogprobEntry, ...]:
        return tuple(self.waiting.pop(t) for t in tokens if t in self.waiting)


class RequestOutputs:
    """The sans-IO core of one request's output actor: scheduler messages in,
    emitter events out.

    After :meth:`close` (the scheduler ended the request) or a failure, it
    is ``ended`` and produces nothing more.
    """

    def __init__(self, config: OutputConfig, scheduler: ChoiceFinisher) -> None:
        self._config = config
        self._scheduler = scheduler
        self._entries = EntryFactory(config.table)
        self._choices = [self._choice(config.index_offset + i) for i in range(config.n)]
        self._cached_tokens = 0
        self.ended = False

    def _choice(self, index: int) -> ChoiceCore:
        config = self._config
        if config.ids_only:
            stops = config.make_pipeline()
            return TokenChoiceOutput(
                index=index,
                stops=stops if stops.matches_stops else None,
                entry=self._entries.entry if config.logprobs else None,
                include_stop_token_text=config.include_stop_token_text,
            )
        return ChoiceOutput(
            index=index,
            pipeline=config.make_pipeline(),
            entries=self._entries,
            with_logprobs=config.logprobs,
            include_stop_token_text=config.include_stop_token_text,
            with_ids=config.token_ids,
        )

    def handle(self, message: RequestOutput) -> list[EmitterEvent]:
        if self.ended:
            return []
        if isinstance(message, StepOutput):
            return self._step(message)
        if isinstance(message, PromptScores):
            return [_prompt_logprobs(message, self._config, self._entries)]
        if isinstance(message, PromptCached):
            self._cached_tokens = message.tokens
            return []
        if isinstance(message, RequestFailed):
            self.ended = True  # no usage follows a failure
            return [Failed(message=message.message, cause=message.cause)]
        return []

    def close(self) -> list[EmitterEvent]:
        """The scheduler's stream ended: choices it did not finish are cut off."""
        if self.ended:
            return []
        self.ended = True
        leftovers = [delta for choice in self._choices for delta in choice.abandon()]
        usage = Completed(
            usage=_usage(self._choices, len(self._config.prompt_ids), self._cached_tokens)
        )
        return [Deltas(deltas=tuple(leftovers)), usage] if leftovers else [usage]

    def _step(self, message: StepOutput) -> list[EmitterEvent]:
        deltas = []
        for sample in message.samples:
            produced, stopped = self._choices[sample.choice].take(sample)
            deltas += produced
            if stopped:
                self._scheduler.finish_choice(self._config.request_id, sample.choice)
        return [Deltas(deltas=tuple(deltas))] if deltas else []


async def run(
    receive: MailboxReader[RequestOutput],
    send: MemoryObjectSendStream[EmitterEvent],
    scheduler: ChoiceFinisher,
    config: OutputConfig,
) -> None:
    """The output actor as its own task, for replies that merge several
    requests' events (a legacy completions request with a list of prompts)."""
    outputs = RequestOutputs(config, scheduler)
    async with receive, send:
        while not outputs.ended:
            try:
                events = outputs.handle(await receive.receive())
            except anyio.EndOfStream:
                events = outputs.close()
            for event in events:
                await put(send, event)


def _usage(choices: list[ChoiceCore], prompt_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(c.tokens_fed for c in choices),
        reasoning_tokens=sum(c.reasoning_tokens for c in choices),
        cached_tokens=cached_tokens,
    )


def _prompt_logprobs(
    scores: PromptScores, config: OutputConfig, entries: EntryFactory
) -> PromptLogprobs:
    return PromptLogprobs(
        entries=tuple(
            None if score is None else entries.entry(token_id, score)
            for token_id, score in zip(config.prompt_ids, scores.entries, strict=True)
        ),
        first_index=config.index_offset,
        n=config.n,
    )
