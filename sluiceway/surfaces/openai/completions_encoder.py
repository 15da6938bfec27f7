"""The legacy completions encoder: output events to ``text_completion``
chunks, or to one ``text_completion`` body.

Both shapes come from one place: :class:`CompletionFragments` turns events
into per-choice fragments; streaming sends each as a chunk, and the whole
reply is the fragments merged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic_core import to_json

from sluiceway.protocol.messages import (
    ChoiceDelta,
    Completed,
    Deltas,
    EmitterEvent,
    Failed,
    LogprobEntry,
    PromptLogprobs,
    Usage,
)
from sluiceway.surfaces.openai.completions_wire import (
    Completion,
    CompletionChoiceWire,
    CompletionLogprobsWire,
)
from sluiceway.surfaces.openai.encoding import (
    DONE,
    KEEPALIVE,
    finish_reason,
    ids_json,
    prompt_entries_wire,
    show_token,
    shown_tokens,
    token_text,
    usage_wire,
)
from sluiceway.surfaces.openai.errors import error_frame
from sluiceway.surfaces.openai.wire import TokenLogprobWire
from sluiceway.surfaces.sse import json_string, sse


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo:
    """A prompt as ``echo`` repeats it: text, token strings, token offsets."""

    text: str
    tokens: tuple[str, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionReplyConfig:
    completion_id: str
    created: int
    model: str
    n: int
    jobs: int
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echoes: tuple[Echo, ...] | None = None
    include_usage: bool = False
    #: Logprob tokens as ``token_id:N``.
    tokens_as_ids: bool = False
    #: ``return_token_ids``: each prompt's ids (None: ids were not asked for).
    prompt_token_ids: tuple[tuple[int, ...], ...] | None = None


def _logprobs(
    entries: tuple[LogprobEntry | None, ...],
    tokens: list[str],
    offsets: list[int],
    k: int,
    as_ids: bool,
) -> CompletionLogprobsWire:
    wire = CompletionLogprobsWire(
        tokens=tokens,
        token_logprobs=[None if e is None else e.logprob for e in entries],
        top_logprobs=[
            None
            if e is None
            else {token_text(t.token, t.token_id, as_ids): t.logprob for t in e.top_logprobs[:k]}
            for e in entries
        ],
        text_offset=offsets,
    )
    if any(e is not None and e.requested for e in entries):
        wire.token_id_logprobs = [
            None if e is None else {str(t): v for t, v in e.requested} for e in entries
        ]
    return wire


class CompletionFragments:
    """Events -> per-choice fragments, tracking each choice's text offset."""

    def __init__(self, config: CompletionReplyConfig) -> None:
        self.config = config
        total = config.n * config.jobs
        self._emitted = [0] * total
        self._waiting_prompt: dict[int, list[TokenLogprobWire | None]] = {}
        #: Choices whose first fragment (which carries the prompt's ids) is to come.
        self._ids_due = set(range(total)) if config.prompt_token_ids is not None else set()
        self._completed = 0
        self._usage = Usage(prompt_tokens=0, completion_tokens=0)
        self.failure: str | None = None

    def opening(self) -> list[CompletionChoiceWire]:
        """Echoed prompts that need no logprobs go out first."""
        echoes = self.config.echoes
        if echoes is None or self.config.logprobs is not None:
            return []
        fragments = []
        for index in range(self.config.n * self.config.jobs):
            echo = echoes[index // self.config.n]
            self._emitted[index] = len(echo.text)
            fragments.append(
                self._with_ids(
                    CompletionChoiceWire(
                        index=index, text=echo.text, logprobs=None, finish_reason=None
                    ),
                    (),
                )
            )
        return fragments

    def _with_ids(
        self, fragment: CompletionChoiceWire, ids: tuple[int, ...]
    ) -> CompletionChoiceWire:
        """``return_token_ids``: the fragment's ids, and on a choice's first
        fragment its prompt's."""
        prompts = self.config.prompt_token_ids
        if prompts is None:
            return fragment
        fragment.token_ids = list(ids)
        if fragment.index in self._ids_due:
            self._ids_due.discard(fragment.index)
            fragment.prompt_token_ids = list(prompts[fragment.index // self.config.n])
        return fragment

    def fragments(self, event: EmitterEvent) -> list[CompletionChoiceWire]:
        if isinstance(event, Deltas):
            return [self.fragment(delta) for delta in event.deltas]
        if isinstance(event, PromptLogprobs):
            return self._prompt(event)
        if isinstance(event, Completed):
            self._completed += 1
            self._usage = Usage(
                prompt_tokens=self._usage.prompt_tokens + event.usage.prompt_tokens,
                completion_tokens=self._usage.completion_tokens + event.usage.completion_tokens,
                reasoning_tokens=self._usage.reasoning_tokens + event.usage.reasoning_tokens,
                cached_tokens=self._usage.cached_tokens + event.usage.cached_tokens,
            )
        elif isinstance(event, Failed):
            self.failure = event.message
        return []

    @property
    def usage(self) -> Usage | None:
        """The summed usage, once every prompt's request has completed."""
        return self._usage if self._completed == self.config.jobs else None

    def _prompt(self, event: PromptLogprobs) -> list[CompletionChoiceWire]:
        config = self.config
        prompt_wire = None
        if config.prompt_logprobs is not None:
            prompt_wire = prompt_entries_wire(
                event.entries, config.prompt_logprobs, config.tokens_as_ids
            )
        fragments = []
        for index in range(event.first_index, event.first_index + event.n):
            if config.echoes is None:
                if prompt_wire is not None:
                    self._waiting_prompt[index] = prompt_wire
                continue
            echo = config.echoes[index // config.n]
            self._emitted[index] = len(echo.text)
            fragment = self._with_ids(
                CompletionChoiceWire(
                    index=index, text=echo.text, logprobs=None, finish_reason=None
                ),
                (),
            )
            if config.logprobs is not None:
                fragment.logprobs = _logprobs(
                    event.entries,
                    list(echo.tokens),
                    list(echo.offsets),
                    config.logprobs,
                    config.tokens_as_ids,
                )
            if prompt_wire is not None:
                fragment.prompt_logprobs = prompt_wire
            fragments.append(fragment)
        return fragments

    def plain(self, delta: ChoiceDelta) -> int | None:
        """When the delta's fragment is just its index, text and logprobs (and
        ids), the choice's text offset before it; it then counts as sent.
        ``None`` for any other fragment."""
        if (
            delta.finish is not None
            or delta.index in self._waiting_prompt
            or delta.index in self._ids_due
        ):
            return None
        base = self._emitted[delta.index]
        self._emitted[delta.index] = base + len(delta.content)
        return base

    def fragment(self, delta: ChoiceDelta) -> CompletionChoiceWire:
        fragment = CompletionChoiceWire(
            index=delta.index,
            text=delta.content,
            logprobs=None,
            finish_reason=finish_reason(delta),
        )
        k = self.config.logprobs
        if k is not None and delta.logprobs is not None:
            base = self._emitted[delta.index]
            content = delta.logprobs.content
            as_ids = self.config.tokens_as_ids
            fragment.logprobs = _logprobs(
                content,
                [token_text(entry.token, entry.token_id, as_ids) for entry in content],
                [base + offset for offset in delta.logprobs.content_offsets],
                k,
                as_ids,
            )
        self._emitted[delta.index] += len(delta.content)
        if delta.finish is not None:
            fragment.matched_stop = delta.matched_stop
        waiting = self._waiting_prompt.pop(delta.index, None)
        if waiting is not None:
            fragment.prompt_logprobs = waiting
        return self._with_ids(fragment, delta.token_ids)


class LogprobsJson:
    """A streamed fragment's ``logprobs`` as JSON text: what
    ``CompletionLogprobsWire.to_json()`` gives for it.

    As for chat (``EntryJson``), building and dumping the models cost more
    than the rest of a token's frame: here the fragment is plain dicts and
    lists, dumped by pydantic's own serialiser in one call. A token's key in
    ``top_logprobs`` (its text, or ``token_id:N``) is made once per id
    (:func:`shown_tokens`, which chat's entries share). ``top_logprobs`` is
    a JSON object keyed by text, so two alternatives that read alike share
    one key, holding the later one's logprob where the first one stood: a
    dict does that, as the model's does.
    """

    __slots__ = ("_as_ids", "_top")

    def __init__(self, top: int, as_ids: bool) -> None:
        self._top = top
        self._as_ids = as_ids

    def json(self, entries: tuple[LogprobEntry, ...], offsets: list[int]) -> bytes:
        as_ids, top = self._as_ids, self._top
        tokens: list[str] = []
        alternatives: list[dict[str, float]] = []
        for entry in entries:
            vocabulary = entry.vocabulary
            shown = shown_tokens(vocabulary, as_ids)
            token = shown.get(entry.token_id) or show_token(vocabulary, as_ids, entry.token_id)
            tokens.append(token[0])
            alternatives.append(
                {
                    (shown.get(t) or show_token(vocabulary, as_ids, t))[0]: v
                    for t, v in entry.top[:top]
                }
            )
        fragment: dict[str, object] = {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": alternatives,
            "text_offset": offsets,
        }
        if any(entry.requested for entry in entries):
            # One key per id, as the model's dict has.
            fragment["token_id_logprobs"] = [
                {str(t): v for t, v in entry.requested} for entry in entries
            ]
        return to_json(fragment, inf_nan_mode="null")


class CompletionStreamEncoder:
    def __init__(self, config: CompletionReplyConfig) -> None:
        self._fragments = CompletionFragments(config)
        self._config = config
        self._logprobs = (
            None if config.logprobs is None else LogprobsJson(config.logprobs, config.tokens_as_ids)
        )
        # Most frames of a stream carry only text: a template around the index
        # and the text is several times cheaper than building and dumping models.
        self._with_ids = config.prompt_token_ids is not None
        bare_choice = CompletionChoiceWire(index=0, text="", logprobs=None, finish_reason=None)
        if self._with_ids:
            bare_choice.token_ids = []
        head, _, tail = self._chunk(bare_choice).partition(b'{"index":0,"text":""')
        before, marker, after = tail.partition(b'"token_ids":[')
        self._head, self._tail, self._ids_tail = head + b'{"index":', before + marker, after
        no_logprobs = b',"logprobs":null'
        assert self._tail.startswith(no_logprobs), "the template's logprobs follow its text"
        self._after_logprobs = self._tail[len(no_logprobs) :]

    def _chunk(self, fragment: CompletionChoiceWire) -> bytes:
        chunk = Completion(
            id=self._config.completion_id,
            created=self._config.created,
            model=self._config.model,
            choices=[fragment],
        )
        if self._config.include_usage:
            chunk.usage = None
        return sse(chunk.to_json())

    def start(self) -> bytes:
        return b"".join(self._chunk(f) for f in self._fragments.opening())

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def encode(self, event: EmitterEvent) -> bytes:
        if isinstance(event, Deltas):
            deltas = event.deltas
            if len(deltas) == 1:  # one choice's token: most frames of a stream
                return self._delta_frame(deltas[0])
            return b"".join([self._delta_frame(delta) for delta in deltas])
        frames = b"".join(self._chunk(f) for f in self._fragments.fragments(event))
        if isinstance(event, Failed):
            return frames + error_frame(event.message) + DONE
        usage = self._fragments.usage
        if isinstance(event, Completed) and usage is not None:
            if self._config.include_usage:
                tail = Completion(
                    id=self._config.completion_id,
                    created=self._config.created,
                    model=self._config.model,
                    choices=[],
                    usage=usage_wire(usage),
                )
                frames += sse(tail.to_json())
            frames += DONE
        return frames

    def _delta_frame(self, delta: ChoiceDelta) -> bytes:
        base = self._fragments.plain(delta)
        if base is None:
            return self._chunk(self._fragments.fragment(delta))
        text = json_string(delta.content)
        frame = self._head + str(delta.index).encode() + b',"text":' + text
        logprobs = delta.logprobs
        if logprobs is None or self._logprobs is None:
            frame += self._tail
        else:
            offsets = [base + offset for offset in logprobs.content_offsets]
            entries = self._logprobs.json(logprobs.content, offsets)
            frame += b',"logprobs":' + entries + self._after_logprobs
        if self._with_ids:
            frame += ids_json(delta.token_ids) + self._ids_tail
        return frame


@dataclass(slots=True)
class _Merged:
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    token_id_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: str | int | None = None
    prompt_logprobs: list[TokenLogprobWire | None] | None = None
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None

    def add(self, fragment: CompletionChoiceWire) -> None:
        self.text.append(fragment.text)
        self.token_ids += fragment.token_ids or ()
        if fragment.prompt_token_ids is not None:
            self.prompt_token_ids = fragment.prompt_token_ids
        if fragment.logprobs is not None:
            self.tokens += fragment.logprobs.tokens
            self.token_logprobs += fragment.logprobs.token_logprobs
            self.top_logprobs += fragment.logprobs.top_logprobs
            self.text_offset += fragment.logprobs.text_offset
            scored = fragment.logprobs.token_id_logprobs
            self.token_id_logprobs += scored or [None] * len(fragment.logprobs.tokens)
        if fragment.finish_reason is not None:
            self.finish_reason = fragment.finish_reason
            self.matched_stop = fragment.matched_stop
        if fragment.prompt_logprobs is not None:
            self.prompt_logprobs = fragment.prompt_logprobs


class CompletionAccumulator:
    """Events -> one ``text_completion`` (non-streaming)."""

    def __init__(self, config: CompletionReplyConfig) -> None:
        self._config = config
        self._fragments = CompletionFragments(config)
        self._choices = [_Merged() for _ in range(config.n * config.jobs)]
        for fragment in self._fragments.opening():
            self._choices[fragment.index].add(fragment)

    @property
    def failure(self) -> str | None:
        return self._fragments.failure

    def add(self, event: EmitterEvent) -> None:
        for fragment in self._fragments.fragments(event):
            self._choices[fragment.index].add(fragment)

    def to_json(self) -> str:
        return self.build().to_json()

    def build(self) -> Completion:
        usage = self._fragments.usage
        assert usage is not None, "build() before every request completed"
        return Completion(
            id=self._config.completion_id,
            created=self._config.created,
            model=self._config.model,
            choices=[self._choice(index, merged) for index, merged in enumerate(self._choices)],
            usage=usage_wire(usage),
        )

    def _choice(self, index: int, merged: _Merged) -> CompletionChoiceWire:
        logprobs = None
        if self._config.logprobs is not None:
            logprobs = CompletionLogprobsWire(
                tokens=merged.tokens,
                token_logprobs=merged.token_logprobs,
                top_logprobs=merged.top_logprobs,
                text_offset=merged.text_offset,
            )
            if any(scores is not None for scores in merged.token_id_logprobs):
                logprobs.token_id_logprobs = merged.token_id_logprobs
        choice = CompletionChoiceWire(
            index=index,
            text="".join(merged.text),
            logprobs=logprobs,
            finish_reason=merged.finish_reason,
            matched_stop=merged.matched_stop,
        )
        if self._config.prompt_logprobs is not None:
            choice.prompt_logprobs = merged.prompt_logprobs
        if self._config.prompt_token_ids is not None:
            choice.prompt_token_ids = merged.prompt_token_ids
            choice.token_ids = merged.token_ids
        return choice
