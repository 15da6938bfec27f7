"""Emitters: the template fast path frames exactly what the models would,
and the reasoning field setting is honoured in streams and whole replies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluiceway.actors.emitters.chat import (
    ChatAccumulator,
    ChatReplyConfig,
    ChatStreamEncoder,
    ReasoningField,
)
from sluiceway.protocol.messages import ChoiceDelta, Completed, Deltas, Usage

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
