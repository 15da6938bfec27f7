"""gpt-oss harmony read by token id (``sluiceway.parsers.harmony``).

Documents are lists of markers (special token ids) and text; text between
markers is split into tokens anywhere (mid-character included), and the
routed result is checked against the document's own description (ground
truth), with the alignment contract over every run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import Channel, Span
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
from sluiceway.protocol.tokens import TokenTable
from sluiceway.server.config import CHOICES

from .harness import (
    MULTIBYTE,
    PLAIN,
    Routed,
    Tokenized,
    assert_contract,
    chunk_texts,
    examples,
    run_pipeline,
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
    tokenized = tokenize(items, cuts)
    reader = HarmonyParser(HarmonyTokens.of(tokenized.table), parallel_tool_calls=parallel)
    reader.prime(prime)
    eos = frozenset(MARKERS.index(m) for m in EOS_MARKERS)
    run = run_pipeline(tokenized, [], reader=reader, eos=eos)
    assert_contract(run)
    return chunk_texts(run), [chunk for _, chunk in run.all_chunks()]


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
