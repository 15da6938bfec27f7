"""OpenAI encoders: the template fast path frames exactly what the models would,
and the reasoning field setting is honoured in streams and whole replies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sluiceway.surfaces.openai.chat_encoder import (
    ChatAccumulator,
    ChatReplyConfig,
    ChatStreamEncoder,
    ReasoningField,
)
from sluiceway.surfaces.openai.completions_encoder import (
    CompletionReplyConfig,
    CompletionStreamEncoder,
)

from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    Completed,
    Deltas,
    LogprobEntry,
    Usage,
)

FIELDS: tuple[ReasoningField, ...] = ("reasoning_content", "reasoning", "both")


def config(field: ReasoningField = "reasoning_content", usage: bool = False) -> ChatReplyConfig:
    return ChatReplyConfig(
        completion_id="chatcmpl-1",
        created=7,
        model='m"odel',
        n=3,
        logprobs=False,
        include_usage=usage,
        reasoning_field=field,
    )


@given(
    text=st.text(min_size=1),
    index=st.integers(0, 2),
    reasoning=st.booleans(),
    field=st.sampled_from(FIELDS),
    usage=st.booleans(),
)
def test_text_frames_match_the_models(
    text: str, index: int, reasoning: bool, field: ReasoningField, usage: bool
) -> None:
    delta = (
        ChoiceDelta(index=index, reasoning=text)
        if reasoning
        else ChoiceDelta(index=index, content=text)
    )
    fast = ChatStreamEncoder(config(field, usage))
    slow = ChatStreamEncoder(config(field, usage))
    slow._text_frame = lambda _: None  # type: ignore[method-assign]
    framed = fast.encode(Deltas(deltas=(delta,)))
    assert framed.startswith(b"data: ")
    assert framed.index(b"\n") == len(framed) - 2  # one line, then the blank line
    assert json.loads(framed[6:]) == json.loads(slow.encode(Deltas(deltas=(delta,)))[6:])


@given(
    texts=st.lists(st.tuples(st.integers(0, 2), st.text()), min_size=1, max_size=6),
    usage=st.booleans(),
    logprobs=st.sampled_from([None, 0, 2]),
)
def test_completion_text_frames_match_the_models(
    texts: list[tuple[int, str]], usage: bool, logprobs: int | None
) -> None:
    def encoder() -> CompletionStreamEncoder:
        return CompletionStreamEncoder(
            CompletionReplyConfig(
                completion_id="cmpl-1",
                created=7,
                model='m"odel',
                n=3,
                jobs=1,
                logprobs=logprobs,
                include_usage=usage,
            )
        )

    fast, slow = encoder(), encoder()
    slow._fragments.text_only = lambda _: False  # type: ignore[method-assign]
    # Every delta before the last carries no logprobs; the last one does
    # one, so it takes the model path wherever logprobs were asked for, and its
    # text_offset shows whether the fast path counted the text already sent.
    entry = LogprobEntry(token="x", token_id=1, logprob=-0.5, bytes=(120,), top_logprobs=())
    scored = ChoiceLogprobs(content=(entry,), content_offsets=(0,))
    deltas = [ChoiceDelta(index=i, content=text) for i, text in texts]
    deltas.append(ChoiceDelta(index=texts[0][0], content="x", logprobs=scored))
    for delta in deltas:
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
