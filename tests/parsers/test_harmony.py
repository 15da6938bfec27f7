"""gpt-oss harmony read by token id (``sluiceway.parsers.harmony``).

Documents are lists of markers (special token ids) and text; text between
markers is split into tokens anywhere (mid-character included), and the
routed result is checked against the document's own description (ground
truth), with the alignment contract over every run.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import PROMPT_OWNER, Channel, Span, ToolCallOpened
from sluiceway.parsers.harmony import HarmonyParser, HarmonyTokens, Marker
from sluiceway.parsers.registry import (
    TextPathOptions,
    build_pipeline,
    build_stages,
    detect_parsers,
    forced_reasoning_close,
    forced_tool_prefix,
    markup_texts,
)
from sluiceway.parsers.stages import StageFinishedError
from sluiceway.protocol.tokens import TokenTable
from sluiceway.server.config import CHOICES

from .harness import (
    MULTIBYTE,
    PLAIN,
    PipelineRun,
    Routed,
    Tokenized,
    assert_contract,
    chunk_texts,
    examples,
    run_pipeline,
    token_spans,
)

PROMPT_END = "<|start|>assistant"
MARKERS = tuple(Marker)
#: Ids the tests feed as end of generation (the engine's EOS ids for gpt-oss).
EOS_MARKERS = (Marker.CALL, Marker.RETURN)

Item = Marker | str


def tokenize(items: Sequence[Item], cuts: Sequence[Sequence[int]] = ()) -> Tokenized:
    """Markers are special ids 0..6; each text item is split at its byte ``cuts``
    (text spelling a marker is a token of its own, as in a real vocabulary)."""
    vocabulary: dict[bytes, int] = {}
    ids: list[int] = []
    texts = iter(cuts)
    for item in items:
        if isinstance(item, Marker):
            ids.append(MARKERS.index(item))
            continue
        data = item.encode()
        points = sorted({c for c in next(texts, ()) if 0 < c < len(data)})
        for a, b in zip([0, *points], [*points, len(data)], strict=True):
            ids.append(vocabulary.setdefault(data[a:b], len(MARKERS) + len(vocabulary)))
    raw = (*(m.value.encode() for m in MARKERS), *vocabulary)
    table = TokenTable(raw, frozenset(range(len(MARKERS))))
    return Tokenized(table, tuple(ids))


def parse(
    items: Sequence[Item],
    cuts: Sequence[Sequence[int]] = (),
    *,
    prime: str = PROMPT_END,
    parallel: bool = True,
) -> tuple[Routed, list[object]]:
    """Run ``items`` through a pipeline whose reader is a primed harmony parser."""
    run = run_of(items, cuts, prime=prime, parallel=parallel)
    return chunk_texts(run), [chunk for _, chunk in run.all_chunks()]


def run_of(
    items: Sequence[Item],
    cuts: Sequence[Sequence[int]] = (),
    *,
    prime: str = PROMPT_END,
    parallel: bool = True,
) -> PipelineRun:
    """``parse``'s run, checked: the alignment contract, and every character
    of every token accounted for once by its owner (``assert_accounted``)."""
    tokenized = tokenize(items, cuts)
    reader = HarmonyParser(HarmonyTokens.of(tokenized.table), parallel_tool_calls=parallel)
    reader.prime(prime)
    eos = frozenset(MARKERS.index(m) for m in EOS_MARKERS)
    run = run_pipeline(tokenized, [], reader=reader, eos=eos)
    assert_contract(run)
    assert_accounted(tokenized, run)
    return run


def reader_spans(run: PipelineRun) -> list[tuple[Span, ToolCallOpened | None]]:
    """Every span the reader emitted, in order, with the call a name span opens."""
    found: list[tuple[Span, ToolCallOpened | None]] = []
    for event in (e for step in run.events for e in step):
        if isinstance(event, ToolCallOpened):
            found += [(span, event) for span in event.name_spans]
        else:
            found.append((event, None))
    return found


def assert_accounted(tokenized: Tokenized, run: PipelineRun) -> None:
    """Each generated token's text comes out once, owned by it, and nothing
    else does (a marker's text is empty); every marker is named by an event
    whose markup is a channel; a name span is a non-empty tool-call span of
    its call."""
    steps = zip(tokenized.ids, token_spans(tokenized), strict=True)
    texts = [
        "" if token_id < len(MARKERS) else "".join(e.text for e in step if isinstance(e, Span))
        for token_id, step in steps
    ]
    owned: dict[int, str] = {}
    for span, call in reader_spans(run):
        if call is not None:
            assert (span.channel, span.tool_index) == (Channel.TOOL_CALL, call.tool_index)
            assert span.text, "an empty name span"
        if span.token == PROMPT_OWNER:
            continue
        assert span.token in range(len(texts)), f"{span} is owned by no token fed"
        owned[span.token] = owned.get(span.token, "") + span.text
        if tokenized.ids[span.token] < len(MARKERS) and span.channel is Channel.DROPPED:
            assert span.markup is not None, f"marker {span.token} is markup of no channel"
    for token, text in enumerate(texts):
        assert Counter(owned.get(token, "")) == Counter(text), f"token {token}"
    markers = [t for t, i in enumerate(tokenized.ids[: run.tokens_fed]) if i < len(MARKERS)]
    assert all(token in owned for token in markers), "a marker no event names"


# -- well-formed documents: ground truth ------------------------------------

BODY_ATOMS = st.sampled_from(
    [
        *MULTIBYTE,
        *PLAIN,
        "<|channel|>",
        "<|end|>",
        " to=functions.x",
        "commentary",
        '{"a": [1, "é"]}',
    ]
)
NAMES = st.sampled_from(["get_weather", "f", "search-web", "ß_tool"])


@dataclass(frozen=True)
class Message:
    channel: str  # analysis, final, commentary
    body: str
    recipient: str | None = None  # the full recipient (functions.NAME, python)
    in_role: bool = False  # the recipient stands in the role header
    ctype: str = ""  # "", " json" or "<|constrain|>json"

    def items(self, first: bool) -> list[Item]:
        role = "" if first else "assistant"
        channel = self.channel
        if self.recipient is not None and self.in_role:
            role += f" to={self.recipient}"
        elif self.recipient is not None:
            channel += f" to={self.recipient}"
        head: list[Item] = [] if first else [Marker.START]
        if role:
            head.append(role)
        head += [Marker.CHANNEL, channel]
        if self.ctype == "<|constrain|>json":
            head += [" ", Marker.CONSTRAIN, "json"]
        elif self.ctype:
            head.append(self.ctype)
        return [*head, Marker.MESSAGE, *([self.body] if self.body else [])]


@st.composite
def messages(draw: st.DrawFn) -> Message:
    body = "".join(draw(st.lists(BODY_ATOMS, max_size=6)))
    kind = draw(st.sampled_from(["analysis", "final", "preamble", "call", "builtin"]))
    ctype = draw(st.sampled_from(["", " json", "<|constrain|>json"]))
    if kind == "call":
        name = "functions." + draw(NAMES)
        return Message("commentary", body, name, draw(st.booleans()), ctype)
    if kind == "builtin":
        name = draw(st.sampled_from(["browser.search", "python"]))
        return Message("analysis", body, name, draw(st.booleans()), ctype)
    channel = "commentary" if kind == "preamble" else kind
    return Message(channel, body, ctype=ctype if kind == "final" else "")


@st.composite
def documents(draw: st.DrawFn) -> tuple[list[Message], list[Item], list[list[int]]]:
    replies = draw(st.lists(messages(), min_size=1, max_size=4))
    items: list[Item] = []
    for index, message in enumerate(replies):
        items += message.items(index == 0)
        last = index == len(replies) - 1
        if not last:
            items.append(Marker.END)
        else:
            items.append(Marker.CALL if message.recipient else Marker.RETURN)
    cuts = []
    for item in items:
        if isinstance(item, str):
            size = len(item.encode())
            cuts.append(draw(st.lists(st.integers(1, max(1, size - 1)), max_size=size)))
    return replies, items, cuts


def expected(replies: Sequence[Message]) -> Routed:
    routed = Routed()
    for message in replies:
        if message.recipient is not None:
            name = message.recipient.removeprefix("functions.")
            routed.calls[len(routed.calls)] = [name, message.body]
        elif message.channel == "analysis":
            routed.reasoning += message.body
        else:
            routed.content += message.body
    return routed


@settings(max_examples=examples(300), deadline=None)
@given(documents())
def test_any_token_split_routes_every_channel(
    document: tuple[list[Message], list[Item], list[list[int]]],
) -> None:
    replies, items, cuts = document
    routed, _ = parse(items, cuts)
    want = expected(replies)
    assert (routed.reasoning, routed.content) == (want.reasoning, want.content)
    assert routed.call_list == want.call_list


@settings(max_examples=examples(100), deadline=None)
@given(documents())
def test_streamed_in_tokens_equals_one_piece_per_text(
    document: tuple[list[Message], list[Item], list[list[int]]],
) -> None:
    """The same document with each text whole (a non-streaming reference)."""
    _, items, cuts = document
    assert parse(items, cuts)[0] == parse(items)[0]


def token_channels(
    replies: Sequence[Message], items: Sequence[Item], cuts: Sequence[Sequence[int]]
) -> list[Channel]:
    """Each token's channel: that of its message, whose tokens are its header
    (markers and text), its body and the marker that closes it."""
    kinds: list[Channel] = []
    for index, message in enumerate(replies):
        kind = (
            Channel.TOOL_CALL
            if message.recipient is not None
            else Channel.REASONING
            if message.channel == "analysis"
            else Channel.CONTENT
        )
        kinds += [kind] * (len(message.items(index == 0)) + 1)
    channels: list[Channel] = []
    texts = iter(cuts)
    for item, kind in zip(items, kinds, strict=True):
        size = 1 if isinstance(item, Marker) else len(item.encode())
        points = {c for c in next(texts, ()) if 0 < c < size} if isinstance(item, str) else set()
        channels += [kind] * (len(points) + 1)
    return channels


@settings(max_examples=examples(200), deadline=None)
@given(documents(), st.booleans())
def test_every_token_rides_with_its_message(
    document: tuple[list[Message], list[Item], list[list[int]]], parallel: bool
) -> None:
    """What the reader says of a token (its spans' channel, a dropped span's
    markup) is its message's channel, a call's whether shown or suppressed."""
    replies, items, cuts = document
    run = run_of(items, cuts, parallel=parallel)
    want = token_channels(replies, items, cuts)
    for span, _ in reader_spans(run):
        if span.token != PROMPT_OWNER:
            said = span.markup if span.channel is Channel.DROPPED else span.channel
            assert said is want[span.token], f"{span}: {want[span.token]}"


# -- the cases the peers got wrong ------------------------------------------


def test_analysis_then_final() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "Think é", Marker.END,
        Marker.START, "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "Hi!", Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items, [[], [3, 7], [], [2, 4], [], [1]])
    assert (routed.reasoning, routed.content, routed.calls) == ("Think é", "Hi!", {})


def test_channel_name_split_across_tokens() -> None:
    items: list[Item] = [Marker.CHANNEL, "commentary", Marker.MESSAGE, "Let me check.", Marker.END]
    routed, _ = parse(items, [[7]])  # comment + ary
    assert routed.content == "Let me check."


def test_constrain_is_a_content_type_never_part_of_a_name() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "commentary to=functions.get_weather", Marker.CONSTRAIN, "json",
        Marker.MESSAGE, '{"city": "Paris"}', Marker.CALL,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert routed.call_list == [("get_weather", '{"city": "Paris"}')]


def test_final_with_constrain_json_is_content() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "final ", Marker.CONSTRAIN, "json", Marker.MESSAGE, '{"a": 1}',
        Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert (routed.content, routed.calls) == ('{"a": 1}', {})


def test_recipient_in_the_role_header() -> None:
    items: list[Item] = [
        " to=functions.f", Marker.CHANNEL, "commentary json", Marker.MESSAGE, "{}", Marker.END,
        Marker.START, "assistant to=functions.g", Marker.CHANNEL, "commentary",
        Marker.MESSAGE, '{"x": 1}', Marker.CALL,
    ]  # fmt: skip
    routed, _ = parse(items, [[2, 5, 12]])
    assert routed.call_list == [("f", "{}"), ("g", '{"x": 1}')]


def test_other_recipients_keep_their_full_name() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis to=browser.search code", Marker.MESSAGE, '{"q": "x"}',
        Marker.CALL,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert (routed.call_list, routed.reasoning, routed.content) == (
        [("browser.search", '{"q": "x"}')],
        "",
        "",
    )


def test_marker_text_in_a_body_is_text() -> None:
    body = "say <|channel|>final<|message|> to=functions.x<|call|>"
    routed, _ = parse([Marker.CHANNEL, "final", Marker.MESSAGE, body, Marker.RETURN])
    assert (routed.content, routed.calls) == (body, {})


def test_a_second_call_is_dropped_without_parallel_calls() -> None:
    call = [Marker.CHANNEL, "commentary to=functions.f", Marker.MESSAGE, "{}"]
    items: list[Item] = [*call, Marker.END, Marker.START, "assistant", *call, Marker.CALL]
    routed, _ = parse(items, parallel=False)
    assert routed.call_list == [("f", "{}")]


# -- malformed output is content, never an exception --------------------------


def test_no_channel_header_is_content_at_once() -> None:
    tokenized = tokenize(["Hello", " world", "!"])
    reader = HarmonyParser(HarmonyTokens.of(tokenized.table))
    reader.prime(PROMPT_END)
    first = reader.feed_token(0, tokenized.ids[0], "Hello")
    shown = [e.text for e in first if isinstance(e, Span) and e.channel is not Channel.DROPPED]
    assert shown == ["Hello"]
    assert reader.held_from is None
    routed, _ = parse(["Hello world", Marker.RETURN], [[5]])
    assert routed.content == "Hello world"


def test_no_start_between_messages() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "a", Marker.END,
        Marker.CHANNEL, "final", Marker.MESSAGE, "b", Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert (routed.reasoning, routed.content) == ("a", "b")


def test_text_after_end_without_a_header_is_content() -> None:
    items: list[Item] = [Marker.CHANNEL, "final", Marker.MESSAGE, "a", Marker.END, "\nb c"]
    routed, _ = parse(items)
    assert routed.content == "a\nb c"


@pytest.mark.parametrize(
    ("items", "content"),
    [
        ([Marker.CHANNEL, "analy"], "analy"),
        ([Marker.CHANNEL, "final", Marker.MESSAGE, "x", Marker.END, Marker.START, "assi"], "xassi"),
        ([" to=functions.f", Marker.CHANNEL, "comm"], " to=functions.fcomm"),
        ([Marker.CHANNEL, "final", Marker.CONSTRAIN, "js"], "finaljs"),
    ],
)
def test_a_truncated_header_is_content(items: list[Item], content: str) -> None:
    routed, _ = parse(items)
    assert (routed.content, routed.reasoning, routed.calls) == (content, "", {})


def test_whitespace_between_messages_is_markup() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "a", Marker.END, "\n",
        Marker.START, "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "b", Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert (routed.reasoning, routed.content) == ("a", "b")


def test_unprimed_reply_starting_with_start() -> None:
    items: list[Item] = [
        Marker.START, "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "ok", Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items, prime="")
    assert routed.content == "ok"


def test_a_call_the_prompt_opened_is_reported_first() -> None:
    prefix = PROMPT_END + "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
    routed, _ = parse(['{"a": 1}', Marker.CALL], prime=prefix)
    assert routed.call_list == [("f", '{"a": 1}')]


# -- alignment: where the entries go -----------------------------------------


def test_markup_entries_ride_with_their_channel() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "r", Marker.END,
        Marker.START, "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "c", Marker.RETURN,
    ]  # fmt: skip
    _, chunks = parse(items)
    reasoning = [t for c in chunks for t in c.tokens(Channel.REASONING)]  # type: ignore[attr-defined]
    content = [t for c in chunks for t in c.tokens(Channel.CONTENT)]  # type: ignore[attr-defined]
    # <|channel|> analysis <|message|> r <|end|>: reasoning; the rest: content.
    assert (reasoning, content) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11])


def test_markers_found_by_name_in_the_vocabulary() -> None:
    table = TokenTable((b"<|channel|>", b"x", b"<|channel|>", b"<|call|>"), frozenset({2, 3}))
    tokens = HarmonyTokens.of(table)
    assert tokens.id_of(Marker.CHANNEL) == 2  # the special one wins over plain text
    assert tokens.id_of(Marker.CALL) == 3
    assert tokens.id_of(Marker.START) is None
    assert HarmonyTokens.of(table) is tokens  # once per vocabulary


def test_arguments_reconstruct_as_json() -> None:
    args = json.dumps({"q": "漢字 🙂", "n": [1, 2]}, ensure_ascii=False)
    items: list[Item] = [
        Marker.CHANNEL,
        "commentary to=functions.f",
        Marker.MESSAGE,
        args,
        Marker.CALL,
    ]
    routed, _ = parse(items, [[], list(range(1, len(args.encode())))])
    assert json.loads(routed.call_list[0][1]) == {"q": "漢字 🙂", "n": [1, 2]}


# -- names and detection ------------------------------------------------------

HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% endfor %}<|start|>assistant"
)
HARMONY_VOCAB = {m.value for m in Marker} | {"a"}


def test_a_harmony_template_is_detected_without_flags() -> None:
    assert detect_parsers(HARMONY_TEMPLATE, HARMONY_VOCAB, ["<|start|>assistant"]) == (
        "openai_gptoss",
        "openai",
    )
    # The markup in a template whose vocabulary lacks the tokens is not harmony.
    assert detect_parsers(HARMONY_TEMPLATE, {"a"}, []) == (None, None)


def test_vllm_names_select_the_reader() -> None:
    assert "openai_gptoss" in CHOICES["reasoning_parser"]
    assert "openai" in CHOICES["tool_call_parser"]
    assert markup_texts("openai_gptoss", "openai") == ()  # markers stay hidden
    assert forced_reasoning_close("openai_gptoss", PROMPT_END) == ""


@pytest.mark.parametrize(
    ("reasoning", "tools"), [("openai_gptoss", None), (None, "openai"), ("openai_gptoss", "openai")]
)
def test_either_name_builds_a_pipeline_reading_harmony(
    reasoning: str | None, tools: str | None
) -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "hm", Marker.END, Marker.START, "assistant",
        Marker.CHANNEL, "commentary to=functions.f", Marker.MESSAGE, "{}", Marker.CALL,
    ]  # fmt: skip
    tokenized = tokenize(items)
    options = TextPathOptions(
        reasoning_parser=reasoning, tool_parser=tools, assistant_prefix=PROMPT_END
    )
    pipeline = build_pipeline(tokenized.table, options)
    chunks = [chunk for token_id in tokenized.ids for chunk in pipeline.feed(token_id)]
    chunks += [*pipeline.finish().chunks]
    assert "".join(chunk.reasoning for chunk in chunks) == "hm"
    calls = [fragment for chunk in chunks for fragment in chunk.tool_calls]
    assert [(f.name, f.arguments) for f in calls] == [("f", ""), (None, "{}")]


@pytest.mark.parametrize(("name", "call"), [("get_weather", "get_weather"), (None, "f")])
def test_a_forced_call_prefix_opens_a_call(name: str | None, call: str) -> None:
    prefix = forced_tool_prefix("openai", name)
    assert prefix.startswith("<|channel|>commentary to=functions.")
    rest = "" if name is not None else "f <|constrain|>json<|message|>"
    items: list[Item] = [*_items_of(rest), '{"a": 1}', Marker.CALL]
    routed, _ = parse(items, prime=PROMPT_END + prefix)
    assert routed.call_list == [(call, '{"a": 1}')]


def _items_of(text: str) -> list[Item]:
    by_name = {m.value: m for m in Marker}
    pieces = re.split("(" + "|".join(re.escape(name) for name in by_name) + ")", text)
    return [by_name.get(piece, piece) for piece in pieces if piece]


def test_stop_strings_end_the_final_channel_not_the_analysis() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "a STOP b", Marker.END, Marker.START,
        "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "c STOP d", Marker.RETURN,
    ]  # fmt: skip
    tokenized = tokenize(items, [[], [2, 5], [], [], [1, 4]])
    options = TextPathOptions(reasoning_parser="openai_gptoss", stop=("STOP",))
    stages, stop = build_stages(options)
    reader = HarmonyParser(HarmonyTokens.of(tokenized.table))
    run = run_pipeline(tokenized, stages, stop, reader=reader)
    assert_contract(run)
    routed = chunk_texts(run)
    assert (routed.reasoning, routed.content, run.stopped_by) == ("a STOP b", "c ", "STOP")


ANY_ITEM = st.one_of(
    st.sampled_from(MARKERS),
    st.sampled_from(["assistant", "analysis", "final", "commentary", " to=functions.f", " json",
                     "to=", " ", "\n", "Hi", "é", "{}", "to=python"]),
)  # fmt: skip


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(ANY_ITEM, max_size=14), st.sampled_from([PROMPT_END, ""]), st.data())
def test_any_sequence_of_markers_and_text_is_routed_without_error(
    items: list[Item], prime: str, data: st.DataObject
) -> None:
    """Malformed output never raises and keeps the alignment contract
    (checked in ``parse``); what it shows never exceeds the text fed."""
    cuts = [
        data.draw(st.lists(st.integers(1, max(1, len(i.encode()) - 1)), max_size=3))
        for i in items
        if isinstance(i, str)
    ]
    routed, _ = parse(items, cuts, prime=prime)
    shown = routed.reasoning + routed.content + "".join(n + a for n, a in routed.call_list)
    assert len(shown) <= sum(len(i) for i in items if isinstance(i, str))


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(ANY_ITEM, max_size=14), st.data())
def test_an_unprimed_reader_reads_as_one_primed_with_the_prompt_end(
    items: list[Item], data: st.DataObject
) -> None:
    """A reply that starts in a header whose role is given: the same chunks,
    at the same steps, whether or not the prompt's ``<|start|>assistant`` was read."""
    cuts = [
        data.draw(st.lists(st.integers(1, max(1, len(i.encode()) - 1)), max_size=3))
        for i in items
        if isinstance(i, str)
    ]
    primed = run_of(items, cuts)
    unprimed = run_of(items, cuts, prime="")
    assert primed.all_chunks() == unprimed.all_chunks()


@pytest.mark.parametrize(
    "items",
    [
        [" ", Marker.START, "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "x"],
        ["\n", Marker.CHANNEL, "analysis", Marker.MESSAGE, "r", Marker.END],
        [" to=functions.f", Marker.CHANNEL, "commentary", Marker.MESSAGE, "{}", Marker.CALL],
    ],
)
def test_leading_text_reads_alike_primed_or_not(items: list[Item]) -> None:
    assert run_of(items).all_chunks() == run_of(items, prime="").all_chunks()


def test_the_markers_of_a_vocabulary() -> None:
    """A plain spelling is a marker when no special token spells it; a later
    special one takes its place."""
    table = TokenTable((b"<|call|>", b"x", b"<|end|>", b"<|end|>"), frozenset({3}))
    assert HarmonyTokens.of(table).markers == {0: Marker.CALL, 3: Marker.END}


def test_parallel_calls_are_the_default() -> None:
    call = [Marker.CHANNEL, "commentary to=functions.f", Marker.MESSAGE, "{}"]
    items: list[Item] = [*call, Marker.END, Marker.START, "assistant", *call, Marker.CALL]
    tokenized = tokenize(items)
    reader = HarmonyParser(HarmonyTokens.of(tokenized.table))
    reader.prime(PROMPT_END)
    run = run_pipeline(tokenized, [], reader=reader)
    assert chunk_texts(run).call_list == [("f", "{}"), ("f", "{}")]


def test_a_prompt_that_opens_a_body_is_continued() -> None:
    prefix = PROMPT_END + "<|channel|>analysis<|message|>Let me"
    routed, _ = parse([" think", Marker.END, Marker.START, "assistant", Marker.CHANNEL, "final",
                       Marker.MESSAGE, "ok", Marker.RETURN], prime=prefix)  # fmt: skip
    assert (routed.reasoning, routed.content) == (" think", "ok")


def test_fed_after_finish_or_finished_twice_raises() -> None:
    reader = HarmonyParser(HarmonyTokens.of(tokenize([]).table))
    reader.finish()
    with pytest.raises(StageFinishedError, match=r"^HarmonyParser was fed after finish\(\)$"):
        reader.feed_token(0, 7, "x")
    with pytest.raises(StageFinishedError, match=r"^HarmonyParser was finished twice$"):
        reader.finish()


@pytest.mark.parametrize(
    "items",
    [
        ["Hello", " world", "!"],
        [Marker.CHANNEL, "final", Marker.MESSAGE, "a", Marker.END, "\nb", " c", "!"],
    ],
)
def test_text_where_no_header_can_be_is_released_as_it_comes(items: list[Item]) -> None:
    tokenized = tokenize(items)
    reader = HarmonyParser(HarmonyTokens.of(tokenized.table))
    reader.prime(PROMPT_END)
    last_marker = max((i for i, item in enumerate(items) if isinstance(item, Marker)), default=-1)
    for token, token_id in enumerate(tokenized.ids):
        text = "" if token_id < len(MARKERS) else tokenized.table.raw_bytes[token_id].decode()
        out = reader.feed_token(token, token_id, text)
        if token > last_marker:  # each item is one token
            shown = [e.text for e in out if isinstance(e, Span) and e.channel is Channel.CONTENT]
            assert ("".join(shown), reader.held_from) == (text, None)


@pytest.mark.parametrize("stray", [Marker.MESSAGE, Marker.CONSTRAIN])
def test_a_stray_marker_in_a_body_is_dropped_and_the_body_goes_on(stray: Marker) -> None:
    items: list[Item] = [Marker.CHANNEL, "analysis", Marker.MESSAGE, "a", stray, "b", Marker.RETURN]
    routed, _ = parse(items)
    assert (routed.reasoning, routed.content) == ("ab", "")


def test_an_end_in_a_header_releases_it_as_content() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "final", Marker.END, Marker.CHANNEL, "final", Marker.MESSAGE, "x",
        Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert (routed.content, routed.reasoning) == ("finalx", "")


def test_a_channel_marker_opens_a_new_header_wherever_it_stands() -> None:
    """In a body (no <|end|>), and right after another channel header."""
    items: list[Item] = [
        Marker.CHANNEL, "final", Marker.MESSAGE, "a", Marker.CHANNEL, "analysis",
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "b", Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items)
    assert (routed.content, routed.reasoning) == ("aanalysis", "b")


def test_whitespace_between_messages_in_several_tokens_is_markup() -> None:
    items: list[Item] = [
        Marker.CHANNEL, "analysis", Marker.MESSAGE, "a", Marker.END, "\n \n",
        Marker.START, "assistant", Marker.CHANNEL, "final", Marker.MESSAGE, "b", Marker.RETURN,
    ]  # fmt: skip
    routed, _ = parse(items, [[], [], [1, 2]])
    assert (routed.reasoning, routed.content) == ("a", "b")


def test_an_analysis_message_with_a_content_type_is_reasoning() -> None:
    items: list[Item] = [Marker.CHANNEL, "analysis json", Marker.MESSAGE, "r", Marker.RETURN]
    routed, _ = parse(items)
    assert (routed.reasoning, routed.content) == ("r", "")


def test_a_reply_cut_mid_character_ends_its_body_with_a_replacement() -> None:
    """The detokenizer's flushed tail goes through the reader, to the open body."""
    raw = (*(m.value.encode() for m in MARKERS), b"analysis", b"a\xc3")
    table = TokenTable(raw, frozenset(range(len(MARKERS))))
    ids = (MARKERS.index(Marker.CHANNEL), 7, MARKERS.index(Marker.MESSAGE), 8)
    reader = HarmonyParser(HarmonyTokens.of(table))
    reader.prime(PROMPT_END)
    run = run_pipeline(Tokenized(table, ids), [], reader=reader)
    assert_contract(run)
    assert (chunk_texts(run).reasoning, chunk_texts(run).content) == ("a\ufffd", "")
