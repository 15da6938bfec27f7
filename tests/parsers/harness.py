"""Test harness for the text stages and whole text paths.

- Synthetic token tables: any split of a document's UTF-8 bytes becomes a
  vocabulary whose tokens are exactly those pieces (so characters can be split
  mid-byte and tags at every point).
- Runners that feed stages token by token (or in random groups), or whole.
- Independent reference parsers for the grammars, written the obvious
  non-incremental way (``str.find``, ``re``, ``json``).
- A checker for the alignment contract that reads the chunks a pipeline
  produced and compares them with what the routed events say.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from sluiceway.parsers.assembler import Chunk
from sluiceway.parsers.detokenizer import IncrementalDetokenizer
from sluiceway.parsers.events import (
    PROMPT_OWNER,
    VISIBLE_CHANNELS,
    Channel,
    Event,
    Span,
    ToolCallOpened,
    content,
)
from sluiceway.parsers.pipeline import ChoicePipeline, StopStage, TextStage, TokenReader
from sluiceway.protocol.tokens import TokenTable

WS = " \t\r\n"

#: SLUICEWAY_SOAK=20 multiplies every property test's example count (a soak
#: run); below 1 it divides it (`make mutate` runs each mutant's tests at 0.1).
SOAK = float(os.environ.get("SLUICEWAY_SOAK", "1"))


def examples(count: int) -> int:
    return max(1, round(count * SOAK))


# -- synthetic tokenizations -------------------------------------------------


@dataclass(frozen=True)
class Tokenized:
    """A document split into tokens: the table and the id sequence."""

    table: TokenTable
    ids: tuple[int, ...]

    @property
    def pieces(self) -> list[bytes]:
        return [self.table.raw_bytes[i] for i in self.ids]


def tokenize(data: bytes, cuts: Iterable[int], *, eos: bool = False) -> Tokenized:
    """Split ``data`` at the byte offsets ``cuts``; ids are the distinct pieces."""
    points = sorted({c for c in cuts if 0 < c < len(data)})
    bounds = [0, *points, len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    vocabulary: dict[bytes, int] = {}
    ids = [vocabulary.setdefault(piece, len(vocabulary)) for piece in pieces]
    raw = list(vocabulary)
    hidden: frozenset[int] = frozenset()
    if eos:
        raw.append(b"<|im_end|>")
        hidden = frozenset({len(raw) - 1})
        ids.append(len(raw) - 1)
    return Tokenized(TokenTable(tuple(raw), hidden), tuple(ids))


@st.composite
def tokenizations(draw: st.DrawFn, text: str, *, eos: bool | None = None) -> Tokenized:
    """Random splits of ``text``'s bytes: anywhere, every byte, every character, or few."""
    data = text.encode()
    mode = draw(st.sampled_from(["random", "random", "bytes", "chars", "sparse"]))
    if mode == "bytes":
        cuts: set[int] = set(range(1, len(data)))
    elif mode == "chars":
        cuts = set()
        offset = 0
        for char in text:
            offset += len(char.encode())
            cuts.add(offset)
    elif len(data) < 2:
        cuts = set()
    elif mode == "sparse":
        cuts = draw(st.sets(st.integers(1, len(data) - 1), max_size=4))
    else:
        density = draw(st.sampled_from([2, 3, 5, 8]))
        cuts = draw(st.sets(st.integers(1, len(data) - 1), max_size=max(1, len(data) // density)))
    with_eos = draw(st.booleans()) if eos is None else eos
    return tokenize(data, cuts, eos=with_eos)


def token_spans(tokenized: Tokenized) -> list[list[Event]]:
    """Per token, the content span the detokenizer releases (as the pipeline feeds stages)."""
    detokenizer = IncrementalDetokenizer(tokenized.table)
    steps: list[list[Event]] = []
    for index, token_id in enumerate(tokenized.ids):
        text = detokenizer.feed(token_id)
        steps.append([content(index, text)] if text else [])
    tail = detokenizer.finish()
    if tail:
        raise AssertionError("test documents are valid UTF-8")
    return steps


def owners_of(steps: Sequence[Sequence[Event]]) -> list[int]:
    """The owner of each input character, in order."""
    owners: list[int] = []
    for events in steps:
        for event in events:
            if isinstance(event, Span):
                owners.extend([event.token] * len(event.text))
    return owners


# -- running stages ----------------------------------------------------------


@dataclass
class StageRun:
    """What a chain of stages emitted: per feed call, and from finish."""

    steps: list[list[Event]] = field(default_factory=list)
    held: list[list[int | None]] = field(default_factory=list)  # held_from per stage, per step

    @property
    def events(self) -> list[Event]:
        return [event for step in self.steps for event in step]


def run_chain(stages: Sequence[TextStage], groups: Sequence[Sequence[Event]]) -> StageRun:
    """Feed each group through the chain (like the pipeline does), then finish."""
    run = StageRun()
    for group in groups:
        events = list(group)
        for stage in stages:
            events = stage.feed(events)
        run.steps.append(events)
        run.held.append([stage.held_from for stage in stages])
    events = []
    for stage in stages:
        events = stage.feed(events) + stage.finish()
    run.steps.append(events)
    return run


def run_whole(stages: Sequence[TextStage], text: str) -> StageRun:
    """Non-streaming: the whole text as one span of token 0, then finish."""
    return run_chain(stages, [[content(0, text)]] if text else [])


def regroup(steps: Sequence[Sequence[Event]], cuts: Iterable[int]) -> list[list[Event]]:
    """Join consecutive per-token steps into feed calls (random chunking)."""
    points = sorted({c for c in cuts if 0 < c < len(steps)})
    bounds = [0, *points, len(steps)]
    return [[e for step in steps[a:b] for e in step] for a, b in itertools.pairwise(bounds)]


# -- reading results ---------------------------------------------------------


@dataclass
class Routed:
    """Events merged per channel; tool calls as (name, arguments) per index."""

    reasoning: str = ""
    content: str = ""
    dropped: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)

    @property
    def call_list(self) -> list[tuple[str, str]]:
        return [(self.calls[i][0], self.calls[i][1]) for i in sorted(self.calls)]


def route(events: Iterable[Event]) -> Routed:
    routed = Routed()
    for event in events:
        if isinstance(event, ToolCallOpened):
            if event.tool_index in routed.calls:
                raise AssertionError(f"tool call {event.tool_index} opened twice")
            routed.calls[event.tool_index] = [event.name, ""]
        elif event.channel is Channel.REASONING:
            routed.reasoning += event.text
        elif event.channel is Channel.CONTENT:
            routed.content += event.text
        elif event.channel is Channel.TOOL_CALL:
            if event.tool_index not in routed.calls:
                raise AssertionError(f"arguments of tool call {event.tool_index} before it opened")
            routed.calls[event.tool_index][1] += event.text
        else:
            routed.dropped += event.text
    if sorted(routed.calls) != list(range(len(routed.calls))):
        raise AssertionError(f"tool call indices jump: {sorted(routed.calls)}")
    return routed


def emitted_spans(events: Iterable[Event]) -> list[Span]:
    """Every span in stream order, a call's name spans where the name was."""
    spans: list[Span] = []
    for event in events:
        if isinstance(event, ToolCallOpened):
            spans.extend(event.name_spans)
        else:
            spans.append(event)
    return [span for span in spans if span.token != PROMPT_OWNER]


def assert_accounts_for(input_steps: Sequence[Sequence[Event]], run: StageRun) -> None:
    """Every input character comes out exactly once, in order, with its owner
    (for stages that route text without synthesising any)."""
    expected_text = "".join(e.text for step in input_steps for e in step if isinstance(e, Span))
    spans = emitted_spans(run.events)
    assert "".join(s.text for s in spans) == expected_text
    out_owners = [s.token for s in spans for _ in s.text]
    assert out_owners == owners_of(input_steps)


def assert_held_from(input_steps: Sequence[Sequence[Event]], run: StageRun, stage: int = 0) -> None:
    """``held_from`` names the owner of the first character fed but not yet emitted
    (single text-routing stage runs only)."""
    owners = owners_of(input_steps)
    fed = 0
    emitted = 0
    for index, (step_in, step_out) in enumerate(zip(input_steps, run.steps, strict=False)):
        fed += sum(len(e.text) for e in step_in if isinstance(e, Span))
        emitted += sum(len(s.text) for s in emitted_spans(step_out))
        held = run.held[index][stage]
        expected = owners[emitted] if emitted < fed else None
        assert held == expected, f"step {index}: held_from {held}, expected {expected}"


# -- reference parsers -------------------------------------------------------


def ref_reasoning(
    text: str, *, starts_in_reasoning: bool, primed: str = "start"
) -> tuple[str, str]:
    """(reasoning, content) the obvious way."""
    reasoning = ""
    state = primed
    if state == "start":
        opened = re.match(r"[ \t\r\n]*<think>", text)
        if opened:
            text = text[opened.end() :]
            state = "reasoning"
        else:
            state = "reasoning" if starts_in_reasoning else "content"
    if state == "reasoning":
        end = text.find("</think>")
        if end < 0:
            return text, ""
        reasoning, text, state = text[:end], text[end + len("</think>") :], "closed"
    if state == "closed":
        text = text.lstrip(WS)
    return reasoning, text


def ref_stop(
    text: str, owners: Sequence[int], stops: Sequence[str], min_tokens: int = 0
) -> tuple[int, str] | None:
    """The first counted match to complete (ties: the longest, which starts
    first), as (start, stop)."""
    by_length = sorted(set(stops), key=len, reverse=True)
    for end in range(1, len(text) + 1):
        if owners[end - 1] < min_tokens:
            continue
        for stop in by_length:
            if text.endswith(stop, 0, end):
                return end - len(stop), stop
    return None


class UnsupportedDocument(Exception):
    """The reference parser does not model this (post-commit malformed envelope)."""


_HERMES_HEAD = re.compile(
    r'<tool_call>[ \t\r\n]*\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*"([^"\\<>\s\x00-\x1f]+)"'
)
_HERMES_ARGS = re.compile(r'[ \t\r\n]*,[ \t\r\n]*"arguments"[ \t\r\n]*:[ \t\r\n]*')
_HERMES_TAIL = re.compile(r"[ \t\r\n]*\}[ \t\r\n]*</tool_call>[ \t\r\n]*")


def ref_hermes(text: str, *, parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) for well-formed calls and pre-name near misses."""
    decoder = json.JSONDecoder()
    out: list[str] = []
    calls: list[tuple[str, str]] = []
    position = 0
    seen = 0
    while True:
        start = text.find("<tool_call>", position)
        if start < 0:
            out.append(text[position:])
            return "".join(out), calls
        out.append(text[position:start])
        head = _HERMES_HEAD.match(text, start)
        if head is None:
            out.append("<")
            position = start + 1
            continue
        args = _HERMES_ARGS.match(text, head.end())
        if args is None:
            raise UnsupportedDocument(text[start:])
        try:
            _, end = decoder.raw_decode(text, args.end())
        except json.JSONDecodeError as error:
            raise UnsupportedDocument(text[start:]) from error
        tail = _HERMES_TAIL.match(text, end)
        if tail is None:
            raise UnsupportedDocument(text[start:])
        if parallel or seen == 0:
            calls.append((head.group(1), text[args.end() : end]))
        seen += 1
        position = tail.end()


# -- the alignment contract --------------------------------------------------


class Recorder:
    """A pass-through stage that records what reaches the assembler, per step."""

    def __init__(self) -> None:
        self.steps: list[list[Event]] = []

    def feed(self, events: Sequence[Event]) -> list[Event]:
        self.steps.append(list(events))
        return list(events)

    def finish(self) -> list[Event]:
        return []

    @property
    def held_from(self) -> int | None:
        return None

    def open_channel(self, upstream: Channel) -> Channel:
        return upstream

    @property
    def transparent(self) -> bool:
        return False  # it must see every step to record it


@dataclass
class PipelineRun:
    chunks: list[tuple[int, Chunk]]  # (step, chunk); step == tokens fed for finish chunks
    final: Chunk
    events: list[list[Event]]  # what reached the assembler, per step (last: finish)
    watermarks: list[int]  # per step, independently of the assembler
    tokens_fed: int
    counts: dict[Channel, int]
    stopped_by: str | None

    def all_chunks(self) -> list[tuple[int, Chunk]]:
        return [*self.chunks, (self.tokens_fed + 1, self.final)]


class Watermarks:
    """Each step's watermark, worked out independently of the assembler: the
    smallest token a stage (or a character the detokenizer is completing)
    still holds text of."""

    def __init__(self, table: TokenTable, stages: Sequence[TextStage | TokenReader]) -> None:
        self._detokenizer = IncrementalDetokenizer(table)
        self._stages = stages
        self._partial_from: int | None = None
        self.values: list[int] = []

    def after(self, step: int, token_id: int, *, visible: bool) -> None:
        text = self._detokenizer.feed(token_id) if visible else ""
        if not self._detokenizer.pending:
            self._partial_from = None
        elif text or self._partial_from is None:
            self._partial_from = step
        held = [s.held_from for s in self._stages if s.held_from is not None]
        partial = [self._partial_from] if self._partial_from is not None else []
        self.values.append(min([step + 1, *held, *partial]))


def run_pipeline(
    tokenized: Tokenized,
    stages: Sequence[TextStage],
    stop: StopStage | None = None,
    *,
    reader: TokenReader | None = None,
    eos: frozenset[int] | None = None,
) -> PipelineRun:
    """``eos``: the ids fed as invisible (default: the table's hidden ids)."""
    recorder = Recorder()
    pipeline = ChoicePipeline(tokenized.table, [*stages, recorder], stop=stop, reader=reader)
    watermarks = Watermarks(tokenized.table, [reader, *stages] if reader else stages)
    chunks: list[tuple[int, Chunk]] = []
    eos = tokenized.table.hidden if eos is None else eos
    for step, token_id in enumerate(tokenized.ids):
        visible = token_id not in eos
        chunks.extend((step, chunk) for chunk in pipeline.feed(token_id, visible=visible))
        watermarks.after(step, token_id, visible=visible)
        if pipeline.stopped_by is not None:
            break
    finished = pipeline.finish()
    fed = pipeline.tokens_fed
    chunks.extend((fed, chunk) for chunk in finished.chunks)
    return PipelineRun(
        chunks=chunks,
        final=finished.final,
        events=recorder.steps,
        watermarks=watermarks.values,
        tokens_fed=fed,
        counts=pipeline.channel_counts(),
        stopped_by=pipeline.stopped_by,
    )


def chunk_texts(run: PipelineRun) -> Routed:
    """What a client reconstructs from the deltas (checks tool-call deltas too:
    a call's name comes first and once, and a chunk holds one fragment per call)."""
    routed = Routed()
    for _, chunk in run.all_chunks():
        routed.reasoning += chunk.reasoning
        routed.content += chunk.content
        indices = [fragment.index for fragment in chunk.tool_calls]
        assert len(set(indices)) == len(indices), "a chunk carries one call in two fragments"
        for fragment in chunk.tool_calls:
            if fragment.name is not None:
                assert fragment.index not in routed.calls, "a call's name came twice"
                assert fragment.index == len(routed.calls), "tool call indices jump"
                routed.calls[fragment.index] = [fragment.name, fragment.arguments]
            else:
                assert fragment.index in routed.calls, "arguments before the call's name"
                routed.calls[fragment.index][1] += fragment.arguments
    return routed


def _carries(chunk: Chunk, channel: Channel) -> bool:
    if channel is Channel.TOOL_CALL:
        return bool(chunk.tool_calls)
    return bool(chunk.reasoning if channel is Channel.REASONING else chunk.content)


def home_chunks(run: PipelineRun) -> tuple[dict[int, tuple[Channel, int]], dict[int, Channel]]:
    """Per token: (home channel, index of the chunk with its first home character);
    and per markup token the channel its markup names (if any)."""
    # Offsets of each token's first character in each channel's event stream.
    first: dict[int, tuple[Channel, object, int]] = {}
    markup: dict[int, Channel] = {}
    lengths: dict[object, int] = {}
    for events in run.events:
        for event in events:
            spans: Sequence[Span]
            if isinstance(event, ToolCallOpened):
                key: object = ("name", event.tool_index)
                for span in event.name_spans:
                    if span.token != PROMPT_OWNER and span.token not in first:
                        first[span.token] = (Channel.TOOL_CALL, key, 0)
                continue
            spans = (event,)
            for span in spans:
                if span.channel is Channel.DROPPED:
                    if span.markup is not None and span.token != PROMPT_OWNER:
                        markup.setdefault(span.token, span.markup)
                    continue
                if not span.text:
                    continue
                key = (span.channel, span.tool_index)
                offset = lengths.get(key, 0)
                if span.token != PROMPT_OWNER and span.token not in first:
                    first[span.token] = (span.channel, key, offset)
                lengths[key] = offset + len(span.text)
    # Which chunk holds each offset of each stream.
    ranges: dict[object, list[tuple[int, int, int]]] = {}
    headers: dict[object, int] = {}
    for index, (_, chunk) in enumerate(run.all_chunks()):
        for channel, text in (
            (Channel.REASONING, chunk.reasoning),
            (Channel.CONTENT, chunk.content),
        ):
            if text:
                key = (channel, -1)
                start = ranges[key][-1][1] if key in ranges else 0
                ranges.setdefault(key, []).append((start, start + len(text), index))
        for fragment in chunk.tool_calls:
            if fragment.name is not None:
                headers[("name", fragment.index)] = index
            if fragment.arguments:
                key = (Channel.TOOL_CALL, fragment.index)
                start = ranges[key][-1][1] if key in ranges else 0
                ranges.setdefault(key, []).append((start, start + len(fragment.arguments), index))
    homes: dict[int, tuple[Channel, int]] = {}
    for token, (channel, key, offset) in first.items():
        if isinstance(key, tuple) and key[0] == "name":
            homes[token] = (channel, headers[key])
            continue
        chunk_index = next(i for a, b, i in ranges[key] if a <= offset < b)
        homes[token] = (channel, chunk_index)
    return homes, markup


def assert_contract(run: PipelineRun, expected: Routed | None = None) -> None:
    """The five guarantees of the alignment contract, for one run."""
    routed = chunk_texts(run)
    stream = route(e for step in run.events for e in step)
    # 1. deltas concatenate to what the stages routed (and to ``expected``).
    assert routed.reasoning == stream.reasoning
    assert routed.content == stream.content
    assert routed.call_list == stream.call_list
    if expected is not None:
        assert routed.reasoning == expected.reasoning
        assert routed.content == expected.content
        assert routed.call_list == expected.call_list
    chunks = run.all_chunks()
    carried: dict[int, tuple[Channel, int]] = {}
    for index, (_, chunk) in enumerate(chunks):
        for channel in VISIBLE_CHANNELS:
            tokens = chunk.tokens(channel)
            assert list(tokens) == sorted(tokens)
            for token in tokens:
                assert token not in carried, f"token {token}'s entry travels twice"
                carried[token] = (channel, index)
    # 4. every token's entry exactly once; counts sum to the tokens fed.
    assert sorted(carried) == list(range(run.tokens_fed))
    assert sum(run.counts.values()) == run.tokens_fed
    for channel in VISIBLE_CHANNELS:
        assert run.counts[channel] == sum(1 for c, _ in carried.values() if c is channel)
    # 2./3. home tokens travel with their first home character.
    homes, markup = home_chunks(run)
    for token, home in homes.items():
        assert carried[token] == home, f"token {token}: carried {carried[token]}, home {home}"
    # Markup tokens: their markup's channel, in the first chunk of that channel
    # once nothing of theirs is held (else the final chunk).
    for token in range(run.tokens_fed):
        if token in homes:
            continue
        channel, index = carried[token]
        if token in markup:
            assert channel is markup[token], f"markup token {token} in {channel}"
        resolved = next(
            (s for s in range(token, len(run.watermarks)) if run.watermarks[s] > token),
            run.tokens_fed,
        )
        expected_index = next(
            (
                i
                for i, (step, chunk) in enumerate(chunks)
                if step >= resolved and _carries(chunk, channel)
            ),
            len(chunks) - 1,
        )
        assert index == expected_index, (
            f"markup token {token}: chunk {index}, expected {expected_index}"
        )
    # 5. per channel, entries leave in token order.
    for channel in VISIBLE_CHANNELS:
        order = [t for _, chunk in chunks for t in chunk.tokens(channel)]
        assert order == sorted(order)
    assert_content_offsets(run)
    # Every span names its owner (events.py): a token fed, or the prompt.
    for event in (e for step in run.events for e in step):
        for span in event.name_spans if isinstance(event, ToolCallOpened) else (event,):
            owner = span.token
            assert owner == PROMPT_OWNER or owner in range(run.tokens_fed), f"{span}: no owner"


def assert_content_offsets(run: PipelineRun) -> None:
    """Each content entry's offset in its chunk's content: where the token's
    first character sits there, else (a markup token) where the first
    character of a later token does, else the end (``Chunk``'s contract),
    worked out from the owners of the routed content characters."""
    owners = [
        event.token
        for step in run.events
        for event in step
        if isinstance(event, Span) and event.channel is Channel.CONTENT
        for _ in event.text
    ]
    start = 0
    for _, chunk in run.all_chunks():
        here = owners[start : start + len(chunk.content)]
        start += len(chunk.content)
        for token, offset in zip(chunk.content_tokens, chunk.content_offsets, strict=True):
            expected = next(
                (i for i, owner in enumerate(here) if owner == token),
                next((i for i, owner in enumerate(here) if owner > token), len(here)),
            )
            assert offset == expected, f"token {token}: content offset {offset}, not {expected}"
    assert start == len(owners)


# -- document pieces ---------------------------------------------------------

MULTIBYTE = ["é", "漢字", "🙂", "ß", "ñ", "e\u0301", "€"]
PLAIN = ["Hello", " world", ".", "\n", " ", "a", "42", "x = 1;", "\t"]
CODE = [
    "if (a<b) { return a; }",
    '<div class="x">',
    "</div>",
    "a < b && c > d",
    "<b>bold</b>",
    "x</",
    "<",
    "</",
    "<<",
    '{"name": "f"}',
    "```python\n",
]
REASONING_NEAR_MISSES = [
    "</thinking>",
    "</thin",
    "</ think>",
    "<think>",
    "<thinking>",
    "</think",
    "<",
]
TOOL_NEAR_MISSES = [
    "<tool_call> x",
    '<tool_call>{"nam!',
    '<tool_call>{"name": 1',
    '<tool_call>{"name": "a b',
    '<tool_call>\n{"name": ""',
    "<tool_call x",
    "<tool_calls>",
    "</tool_call>",
    "<tool",
    "<function=f>",
    "<parameter=x>",
]


def text_atoms(*groups: Sequence[str]) -> st.SearchStrategy[str]:
    return st.sampled_from([atom for group in groups for atom in group])


def joined(atoms: st.SearchStrategy[str], max_size: int = 12) -> st.SearchStrategy[str]:
    return st.lists(atoms, max_size=max_size).map("".join)


JSON_SCALARS = st.one_of(
    st.integers(-1000, 1000),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(alphabet=st.sampled_from(list('ab "\\\n{}[]<>/é漢🙂')), max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(alphabet="abc_", min_size=1, max_size=4), inner, max_size=3),
    ),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(
    st.text(alphabet="abcdef_", min_size=1, max_size=6), JSON_VALUES, max_size=4
)
NAMES = st.sampled_from(["get_weather", "f", "search-web", "a.b", "ß_tool"])


@st.composite
def hermes_call(draw: st.DrawFn) -> tuple[str, str, str]:
    """(text, name, arguments) of a well-formed Hermes call, with varied whitespace."""
    name = draw(NAMES)
    arguments = json.dumps(
        draw(ARGUMENTS), ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1]))
    )
    ws = st.sampled_from(["", " ", "\n", "  ", "\n\n", "\t"])
    text = (
        f'<tool_call>{draw(ws)}{{{draw(ws)}"name"{draw(ws)}:{draw(ws)}"{name}"{draw(ws)},'
        f'{draw(ws)}"arguments"{draw(ws)}:{draw(ws)}{arguments}{draw(ws)}}}{draw(ws)}</tool_call>{draw(ws)}'
    )
    return text, name, arguments


def ok(condition: bool, message: str = "") -> None:
    """An assertion usable inside lambdas (keeps helper code expression-shaped)."""
    if not condition:
        raise AssertionError(message)


Check = Callable[[PipelineRun], None]
