"""OpenAI encoders: the template fast path frames exactly what the models would,
and the reasoning field setting is honoured in streams and whole replies."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    Completed,
    Deltas,
    FinishCause,
    LogprobEntry,
    ToolCallDelta,
    Usage,
)
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces.openai.chat_encoder import (
    ChatAccumulator,
    ChatReplyConfig,
    ChatStreamEncoder,
    ReasoningField,
)
from sluiceway.surfaces.openai.completions_encoder import (
    CompletionAccumulator,
    CompletionReplyConfig,
    CompletionStreamEncoder,
)

FIELDS: tuple[ReasoningField, ...] = ("reasoning_content", "reasoning", "both")
#: Id 1 is "x" and id 9 is "y".
_XY = TokenTable((b"",) + (b"x",) + (b"",) * 7 + (b"y",), frozenset())


def config(
    field: ReasoningField = "reasoning_content",
    usage: bool = False,
    prompt_ids: tuple[int, ...] | None = None,
) -> ChatReplyConfig:
    return ChatReplyConfig(
        completion_id="chatcmpl-1",
        created=7,
        model='m"odel',
        n=3,
        logprobs=False,
        include_usage=usage,
        reasoning_field=field,
        prompt_token_ids=prompt_ids,
    )


@given(
    text=st.text(min_size=1),
    index=st.integers(0, 2),
    reasoning=st.booleans(),
    field=st.sampled_from(FIELDS),
    usage=st.booleans(),
    ids=st.none() | st.lists(st.integers(0, 10**6), max_size=3),
)
def test_text_frames_match_the_models(
    text: str,
    index: int,
    reasoning: bool,
    field: ReasoningField,
    usage: bool,
    ids: list[int] | None,
) -> None:
    token_ids = tuple(ids or ())
    delta = (
        ChoiceDelta(index=index, reasoning=text, token_ids=token_ids)
        if reasoning
        else ChoiceDelta(index=index, content=text, token_ids=token_ids)
    )
    prompt_ids = None if ids is None else (1, 2)
    fast = ChatStreamEncoder(config(field, usage, prompt_ids))
    slow = ChatStreamEncoder(config(field, usage, prompt_ids))
    slow._text_frame = lambda _: None  # type: ignore[method-assign]
    framed = fast.encode(Deltas(deltas=(delta,)))
    assert framed.startswith(b"data: ")
    assert framed.index(b"\n") == len(framed) - 2  # one line, then the blank line
    assert json.loads(framed[6:]) == json.loads(slow.encode(Deltas(deltas=(delta,)))[6:])


#: A vocabulary of up to 51 ids: raw bytes (fragments of characters
#: included, which show as U+FFFD, so that ids that read alike are common)
#: or text with the characters JSON must escape.
_VOCAB = st.lists(
    st.binary(max_size=4) | st.text('ab é€"\\\n\t\x00', max_size=3).map(str.encode),
    min_size=1,
    max_size=51,
).map(lambda pieces: TokenTable(tuple(pieces), frozenset()))
_LOGPROBS = st.floats(max_value=0.0, allow_nan=False) | st.sampled_from([-9999.0, -1e-7, -0.0])


@st.composite
def _entries(draw: st.DrawFn, vocab: TokenTable) -> tuple[LogprobEntry, ...]:
    ids = st.integers(0, len(vocab) - 1)
    entries = []
    for token_id in draw(st.lists(ids, max_size=3)):
        token, raw = vocab.entry_parts(token_id)
        entries.append(
            LogprobEntry(
                token=token,
                token_id=token_id,
                logprob=draw(_LOGPROBS),
                bytes=raw,
                vocabulary=vocab,
                top=tuple((t, draw(_LOGPROBS)) for t in draw(st.lists(ids, max_size=5))),
                requested=tuple((t, draw(_LOGPROBS)) for t in draw(st.lists(ids, max_size=2))),
            )
        )
    return tuple(entries)


@settings(deadline=None)  # a busy host's first examples are slow
@given(data=st.data(), vocab=_VOCAB, as_ids=st.booleans(), with_ids=st.booleans())
def test_text_frames_with_logprobs_match_the_models(
    data: st.DataObject, vocab: TokenTable, as_ids: bool, with_ids: bool
) -> None:
    """The template's logprobs, written from per-token pieces made once per
    id, parse to what the pydantic models give, frame after frame."""

    def encoder() -> ChatStreamEncoder:
        base = config(prompt_ids=(1, 2) if with_ids else None)
        return ChatStreamEncoder(replace(base, logprobs=True, tokens_as_ids=as_ids))

    fast, slow = encoder(), encoder()
    slow._text_frame = lambda _: None  # type: ignore[method-assign]
    for _ in range(data.draw(st.integers(1, 4))):
        reasoning = data.draw(st.booleans())
        logprobs = ChoiceLogprobs(
            content=data.draw(_entries(vocab)),
            reasoning=data.draw(_entries(vocab)),
            tool_calls=data.draw(_entries(vocab)),
        )
        delta = ChoiceDelta(
            index=data.draw(st.integers(0, 2)),
            content=None if reasoning else data.draw(st.text(min_size=1)),
            reasoning=data.draw(st.text(min_size=1)) if reasoning else None,
            logprobs=logprobs,
            token_ids=tuple(data.draw(st.lists(st.integers(0, 99), max_size=3))),
        )
        framed = fast.encode(Deltas(deltas=(delta,)))
        assert framed.startswith(b"data: ")
        assert framed.index(b"\n") == len(framed) - 2
        assert json.loads(framed[6:]) == json.loads(slow.encode(Deltas(deltas=(delta,)))[6:])


def _completion_encoders(
    **options: Any,
) -> tuple[CompletionStreamEncoder, CompletionStreamEncoder]:
    """Two encoders of one reply: the first frames from its template, the
    second always builds the models."""
    config = CompletionReplyConfig(
        completion_id="cmpl-1", created=7, model='m"odel', n=3, jobs=1, **options
    )
    fast, slow = CompletionStreamEncoder(config), CompletionStreamEncoder(config)
    slow._fragments.plain = lambda _: None  # type: ignore[method-assign]
    return fast, slow


@given(
    texts=st.lists(st.tuples(st.integers(0, 2), st.text()), min_size=1, max_size=6),
    usage=st.booleans(),
    logprobs=st.sampled_from([None, 0, 2]),
    with_ids=st.booleans(),
)
def test_completion_text_frames_match_the_models(
    texts: list[tuple[int, str]], usage: bool, logprobs: int | None, with_ids: bool
) -> None:
    fast, slow = _completion_encoders(
        logprobs=logprobs, include_usage=usage, prompt_token_ids=((4, 5),) if with_ids else None
    )
    # Every delta before the last carries no logprobs; the last one does,
    # and its text_offset shows whether the fast path counted the text
    # already sent.
    entry = LogprobEntry(token="x", token_id=1, logprob=-0.5, bytes=(120,), vocabulary=_XY)
    scored = ChoiceLogprobs(content=(entry,), content_offsets=(0,))
    deltas = [
        ChoiceDelta(index=i, content=text, token_ids=(n,) if with_ids else ())
        for n, (i, text) in enumerate(texts)
    ]
    deltas.append(ChoiceDelta(index=texts[0][0], content="x", logprobs=scored))
    for delta in deltas:
        framed = fast.encode(Deltas(deltas=(delta,)))
        assert framed.startswith(b"data: ")
        assert framed.index(b"\n") == len(framed) - 2
        assert json.loads(framed[6:]) == json.loads(slow.encode(Deltas(deltas=(delta,)))[6:])


@settings(deadline=None)
@given(
    data=st.data(),
    vocab=_VOCAB,
    top=st.sampled_from([0, 2, 5]),
    as_ids=st.booleans(),
    with_ids=st.booleans(),
)
def test_completion_frames_with_logprobs_match_the_models(
    data: st.DataObject,
    vocab: TokenTable,
    top: int,
    as_ids: bool,
    with_ids: bool,
) -> None:
    """Completions' logprobs written from per-id keys parse to what the
    pydantic models give (alternatives that read alike share a key), and
    the text offsets count the text the fast path sent before."""

    fast, slow = _completion_encoders(
        logprobs=top, tokens_as_ids=as_ids, prompt_token_ids=((4, 5),) if with_ids else None
    )
    for _ in range(data.draw(st.integers(1, 4))):
        entries = data.draw(_entries(vocab))
        offsets = tuple(
            sorted(
                data.draw(st.lists(st.integers(0, 9), min_size=len(entries), max_size=len(entries)))
            )
        )
        delta = ChoiceDelta(
            index=data.draw(st.integers(0, 2)),
            content=data.draw(st.text()),
            logprobs=data.draw(
                st.none() | st.just(ChoiceLogprobs(content=entries, content_offsets=offsets))
            ),
            token_ids=tuple(data.draw(st.lists(st.integers(0, 99), max_size=3))),
        )
        framed = fast.encode(Deltas(deltas=(delta,)))
        assert framed.startswith(b"data: ")
        assert framed.index(b"\n") == len(framed) - 2
        assert json.loads(framed[6:]) == json.loads(slow.encode(Deltas(deltas=(delta,)))[6:])


@pytest.mark.parametrize("field", FIELDS)
def test_reasoning_field_in_whole_replies(field: ReasoningField) -> None:
    accumulator = ChatAccumulator(config(field))
    accumulator.add(Deltas(deltas=(ChoiceDelta(index=0, reasoning="think", content="say"),)))
    accumulator.add(Completed(usage=Usage(prompt_tokens=1, completion_tokens=2)))
    message = json.loads(accumulator.build().to_json())["choices"][0]["message"]
    expected = {"reasoning_content", "reasoning"} if field == "both" else {field}
    assert {key for key in message if key.startswith("reasoning")} == expected
    assert all(message[key] == "think" for key in expected)
    assert message["content"] == "say"


FINISHES = [
    (FinishCause.EOS, False, "stop"),
    (FinishCause.STOP_STRING, False, "stop"),
    (FinishCause.STOP_TOKEN, False, "stop"),
    (FinishCause.MAX_TOKENS, False, "length"),
    (FinishCause.CANCELLED, False, "stop"),
    (FinishCause.EOS, True, "tool_calls"),
    (FinishCause.STOP_STRING, True, "tool_calls"),
    (FinishCause.MAX_TOKENS, True, "length"),
]


@pytest.mark.parametrize(("cause", "called_tools", "reason"), FINISHES)
def test_finish_causes_are_spelled_alike_in_streams_and_replies(
    cause: FinishCause, called_tools: bool, reason: str
) -> None:
    last = ChoiceDelta(index=0, finish=cause, called_tools=called_tools, matched_stop="x")
    stream = ChatStreamEncoder(config())
    (choice,) = json.loads(stream.encode(Deltas(deltas=(last,)))[6:])["choices"]
    assert (choice["finish_reason"], choice["matched_stop"]) == (reason, "x")
    accumulator = ChatAccumulator(config())
    accumulator.add(Deltas(deltas=(last,)))
    accumulator.add(Completed(usage=Usage(prompt_tokens=1, completion_tokens=1)))
    whole = json.loads(accumulator.build().to_json())["choices"][0]
    assert whole["finish_reason"] == reason
    completions = CompletionStreamEncoder(
        CompletionReplyConfig(completion_id="c", created=1, model="m", n=1, jobs=1)
    )
    (fragment,) = json.loads(completions.encode(Deltas(deltas=(last,)))[6:])["choices"]
    assert fragment["finish_reason"] == reason


def test_tool_call_ids_are_minted_by_the_encoder_once_per_call() -> None:
    """The first fragment of a call (the one with its name) gets an OpenAI id,
    in a stream and in a whole reply alike; later fragments carry none."""
    deltas = (
        ChoiceDelta(index=0, tool_calls=(ToolCallDelta(index=0, arguments="", name="f"),)),
        ChoiceDelta(index=0, tool_calls=(ToolCallDelta(index=0, arguments='{"a": 1}'),)),
        ChoiceDelta(index=0, tool_calls=(ToolCallDelta(index=1, arguments="{}", name="g"),)),
    )
    stream = ChatStreamEncoder(config())
    frames = [json.loads(stream.encode(Deltas(deltas=(d,)))[6:]) for d in deltas]
    calls = [call for f in frames for call in f["choices"][0]["delta"]["tool_calls"]]
    ids = [call.get("id") for call in calls]
    assert ids[1] is None
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in (ids[0], ids[2]))
    assert ids[0] != ids[2]
    accumulator = ChatAccumulator(config())
    accumulator.add(Deltas(deltas=deltas))
    accumulator.add(Completed(usage=Usage(prompt_tokens=1, completion_tokens=3)))
    message = json.loads(accumulator.build().to_json())["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f", "g"]
    whole = [c["id"] for c in message["tool_calls"]]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in whole)
    assert len(set(whole)) == 2


def test_tokens_as_ids_is_the_surfaces_choice() -> None:
    """The output actor carries text and id; the encoder picks what shows."""
    entry = LogprobEntry(
        token="x", token_id=1, logprob=-0.5, bytes=(120,), vocabulary=_XY, top=((9, -2.0),)
    )
    delta = ChoiceDelta(index=0, content="x", logprobs=ChoiceLogprobs(content=(entry,)))
    for as_ids, shown in ((False, ("x", "y")), (True, ("token_id:1", "token_id:9"))):
        reply = ChatReplyConfig(
            completion_id="c", created=1, model="m", n=1, logprobs=True, tokens_as_ids=as_ids
        )
        (choice,) = json.loads(ChatStreamEncoder(reply).encode(Deltas(deltas=(delta,)))[6:])[
            "choices"
        ]
        (wire,) = choice["logprobs"]["content"]
        assert (wire["token"], wire["top_logprobs"][0]["token"]) == shown


def test_return_token_ids_in_chat_streams_and_replies() -> None:
    """Every choice's first chunk carries the prompt's ids; every chunk the
    ids riding with it; the whole reply the same ids, merged."""
    deltas = (
        ChoiceDelta(index=0, reasoning="a", token_ids=(10, 11)),
        ChoiceDelta(index=1, content="b", token_ids=(20,)),
        ChoiceDelta(index=0, content="c", token_ids=(12,)),
        ChoiceDelta(index=0, finish=FinishCause.EOS, token_ids=(13,)),
        ChoiceDelta(index=1, finish=FinishCause.EOS, token_ids=(21,)),
    )
    stream = ChatStreamEncoder(config(prompt_ids=(1, 2)))
    opening = [json.loads(f[6:]) for f in stream.start().split(b"\n\n") if f]
    assert [c["prompt_token_ids"] for c in opening] == [[1, 2]] * 3
    assert [c["choices"][0]["token_ids"] for c in opening] == [[]] * 3
    frames = [json.loads(stream.encode(Deltas(deltas=(d,)))[6:]) for d in deltas]
    assert all("prompt_token_ids" not in f for f in frames)
    streamed = {
        i: [
            t for f in frames if f["choices"][0]["index"] == i for t in f["choices"][0]["token_ids"]
        ]
        for i in (0, 1)
    }
    assert streamed == {0: [10, 11, 12, 13], 1: [20, 21]}
    accumulator = ChatAccumulator(config(prompt_ids=(1, 2)))
    accumulator.add(Deltas(deltas=deltas))
    accumulator.add(Completed(usage=Usage(prompt_tokens=2, completion_tokens=6)))
    whole = json.loads(accumulator.to_json())
    assert whole["prompt_token_ids"] == [1, 2]
    assert [c["token_ids"] for c in whole["choices"]] == [[10, 11, 12, 13], [20, 21], []]
    plain = ChatAccumulator(config())
    plain.add(Deltas(deltas=deltas))
    plain.add(Completed(usage=Usage(prompt_tokens=2, completion_tokens=6)))
    unasked = json.loads(plain.to_json())
    assert "prompt_token_ids" not in unasked
    assert all("token_ids" not in c for c in unasked["choices"])


def test_return_token_ids_in_completions() -> None:
    """Per choice, as vLLM: the prompt's ids on its first fragment (each
    prompt of a list its own), the generated ids on every one."""
    reply = CompletionReplyConfig(
        completion_id="c", created=1, model="m", n=1, jobs=2, prompt_token_ids=((1,), (2, 3))
    )
    deltas = (
        ChoiceDelta(index=0, content="a", token_ids=(10,)),
        ChoiceDelta(index=1, content="b", token_ids=(20,)),
        ChoiceDelta(index=0, content="c", token_ids=(11,)),
        ChoiceDelta(index=0, finish=FinishCause.EOS, token_ids=(12,)),
        ChoiceDelta(index=1, finish=FinishCause.EOS, token_ids=()),
    )
    stream = CompletionStreamEncoder(reply)
    frames = [json.loads(stream.encode(Deltas(deltas=(d,)))[6:])["choices"][0] for d in deltas]
    assert [f.get("prompt_token_ids") for f in frames] == [[1], [2, 3], None, None, None]
    assert [f["token_ids"] for f in frames] == [[10], [20], [11], [12], []]
    accumulator = CompletionAccumulator(reply)
    accumulator.add(Deltas(deltas=deltas))
    for _ in range(2):
        accumulator.add(Completed(usage=Usage(prompt_tokens=1, completion_tokens=2)))
    whole = json.loads(accumulator.to_json())["choices"]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in whole] == [
        ([1], [10, 11, 12]),
        ([2, 3], [20]),
    ]
