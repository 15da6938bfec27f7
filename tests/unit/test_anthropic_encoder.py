"""The Messages encoders on their own: any document (thinking, text, tool
calls) split into any deltas gives one well-formed stream whose blocks equal
the whole reply's; every event has the published shape and the SDK's type;
the template-built frames equal the models' dumps."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from sluiceway.protocol.messages import (
    ChoiceDelta,
    Completed,
    Deltas,
    Failed,
    FinishCause,
    ToolCallDelta,
    Usage,
)
from sluiceway.surfaces.anthropic.blocks import Blocks, stop_reason
from sluiceway.surfaces.anthropic.encoder import (
    MessageAccumulator,
    MessageReplyConfig,
    MessageStreamEncoder,
)
from tests.e2e import anthropic_schemas as schemas

CONFIG = MessageReplyConfig(message_id="msg_test", model="m", input_tokens=7)
EVENTS = TypeAdapter(RawMessageStreamEvent)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
ARGUMENTS = st.one_of(
    st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=6), max_size=3).map(
        json.dumps
    ),
    st.text(max_size=10),  # what a model might write instead of JSON
)
#: A document: what the model wrote, in order, by channel.
SEGMENTS = st.lists(
    st.one_of(
        st.tuples(st.just("thinking"), TEXT),
        st.tuples(st.just("text"), TEXT),
        st.tuples(st.just("tool_use"), st.tuples(st.sampled_from(["a", "b_c"]), ARGUMENTS)),
    ),
    max_size=6,
)


def cut(text: str, data: st.DataObject) -> list[str]:
    points = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=3))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True) if a < b]


def deltas_of(segments: list[tuple[str, Any]], data: st.DataObject) -> list[ChoiceDelta]:
    """The document as the output actor might deliver it: each channel's text
    cut anywhere; sometimes the first piece of one segment rides in the same
    delta as the last of the one before."""
    deltas: list[ChoiceDelta] = []
    calls = 0
    for kind, value in segments:
        pieces: list[ChoiceDelta] = []
        if kind == "tool_use":
            name, arguments = value
            parts = cut(arguments, data) or [""]
            pieces = [
                ChoiceDelta(
                    index=0,
                    tool_calls=(
                        ToolCallDelta(index=calls, arguments=part, name=name if i == 0 else None),
                    ),
                )
                for i, part in enumerate(parts)
            ]
            calls += 1
        else:
            field = "reasoning" if kind == "thinking" else "content"
            pieces = [ChoiceDelta(index=0, **{field: part}) for part in cut(value, data)]
        if deltas and pieces and data.draw(st.booleans()) and _mergeable(deltas[-1], pieces[0]):
            last, first = deltas.pop(), pieces.pop(0)
            pieces.insert(0, _merge(last, first))
        deltas.extend(pieces)
    return deltas


def _mergeable(before: ChoiceDelta, after: ChoiceDelta) -> bool:
    """Whether one delta can carry both (the channel order a model writes in)."""
    order = {"reasoning": 0, "content": 1, "tool_calls": 2}

    def channels(delta: ChoiceDelta) -> list[int]:
        return [order[name] for name in order if getattr(delta, name)]

    return bool(channels(before) and channels(after)) and max(channels(before)) < min(
        channels(after)
    )


def _merge(before: ChoiceDelta, after: ChoiceDelta) -> ChoiceDelta:
    return ChoiceDelta(
        index=0,
        reasoning=before.reasoning + after.reasoning,
        content=before.content + after.content,
        tool_calls=before.tool_calls + after.tool_calls,
    )


def expected_blocks(segments: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    blocks: list[tuple[str, Any]] = []
    for kind, value in segments:
        if kind == "tool_use":
            blocks.append((kind, value[0]))
        elif blocks and blocks[-1][0] == kind:
            blocks[-1] = (kind, blocks[-1][1] + value)
        else:
            blocks.append((kind, value))
    return blocks


def parse_frames(frames: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in frames.decode().split("\n\n"):
        if not frame:
            continue
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ")
        assert data_line.startswith("data: ")
        events.append((event_line[7:], json.loads(data_line[6:])))
    return events


def finished(deltas: list[ChoiceDelta], finish: FinishCause, called: bool) -> list[ChoiceDelta]:
    last = ChoiceDelta(index=0, finish=finish, called_tools=called)
    return [*deltas, last]


@settings(max_examples=60, deadline=None)  # the first example builds the SDK validators
@given(SEGMENTS, st.data())
def test_stream_and_whole_reply_give_the_same_blocks(
    segments: list[tuple[str, Any]], data: st.DataObject
) -> None:
    called = any(kind == "tool_use" for kind, _ in segments)
    deltas = finished(deltas_of(segments, data), FinishCause.EOS, called)
    usage = Usage(prompt_tokens=7, completion_tokens=len(deltas))
    encoder, whole = MessageStreamEncoder(CONFIG), MessageAccumulator(CONFIG)
    frames = encoder.start()
    for delta in deltas:
        frames += encoder.encode(Deltas(deltas=(delta,)))
        whole.add(Deltas(deltas=(delta,)))
    frames += encoder.encode(Completed(usage=usage))
    whole.add(Completed(usage=usage))
    events = parse_frames(frames)
    for name, event in events:
        schemas.check_event(name, event)
        EVENTS.validate_python(event)
    message = json.loads(whole.to_json())
    schemas.check(message, schemas.MESSAGE)
    Message.model_validate(message)
    tool_inputs = [b["input"] for b in message["content"] if b["type"] == "tool_use"]
    # The stream's pieces rebuild the whole reply's blocks.
    rebuilt: list[dict[str, Any]] = []
    for name, event in events:
        if name == "content_block_start":
            rebuilt.append({**event["content_block"], "json": ""})
        elif name == "content_block_delta":
            block, delta = rebuilt[event["index"]], event["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if key:
                block[key] += delta[key]
            elif delta["type"] == "input_json_delta":
                block["json"] += delta["partial_json"]
    for block, whole_block in zip(rebuilt, message["content"], strict=True):
        if block["type"] == "tool_use":
            assert whole_block["input"] == json.loads(block["json"])
            assert block.pop("id").startswith("toolu_")  # each reply mints its own
            del block["input"], whole_block["id"], whole_block["input"]
        del block["json"]
    assert rebuilt == message["content"]
    assert [
        (block["type"], block.get("thinking", block.get("text", block.get("name"))))
        for block in message["content"]
    ] == expected_blocks(segments)
    for kind, value in segments:  # arguments that are an object pass unchanged
        if kind == "tool_use" and isinstance(_loads(value[1]), dict):
            assert _loads(value[1]) in tool_inputs
    assert message["stop_reason"] == ("tool_use" if called else "end_turn")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        (ChoiceDelta(index=0, finish=FinishCause.EOS), ("end_turn", None)),
        (ChoiceDelta(index=0, finish=FinishCause.STOP_TOKEN), ("end_turn", None)),
        (ChoiceDelta(index=0, finish=FinishCause.EOS, called_tools=True), ("tool_use", None)),
        (
            ChoiceDelta(index=0, finish=FinishCause.MAX_TOKENS, called_tools=True),
            ("max_tokens", None),
        ),
        (
            ChoiceDelta(index=0, finish=FinishCause.STOP_STRING, matched_stop="STOP"),
            ("stop_sequence", "STOP"),
        ),
        (ChoiceDelta(index=0, finish=FinishCause.CANCELLED), ("end_turn", None)),
    ],
)
def test_stop_reasons(delta: ChoiceDelta, expected: tuple[str, str | None]) -> None:
    assert stop_reason(delta) == expected


def test_a_failure_after_the_start_is_an_error_event_and_keepalive_is_ping() -> None:
    encoder = MessageStreamEncoder(CONFIG)
    ((name, event),) = parse_frames(encoder.encode(Failed(message="engine died")))
    assert name == "error"
    assert event == {"type": "error", "error": {"type": "api_error", "message": "engine died"}}
    schemas.check(event, schemas.ERROR)
    assert parse_frames(encoder.keepalive()) == [("ping", {"type": "ping"})]


def test_tool_ids_are_minted_where_a_block_opens() -> None:
    ids = iter(["toolu_1", "toolu_2"])
    blocks = Blocks(mint_id=lambda: next(ids))
    events = blocks.feed(
        ChoiceDelta(
            index=0,
            tool_calls=(
                ToolCallDelta(index=0, name="a", arguments='{"x"'),
                ToolCallDelta(index=0, arguments=": 1}"),
                ToolCallDelta(index=1, name="b", arguments=""),
            ),
            finish=FinishCause.EOS,
            called_tools=True,
        )
    )
    opened = [(e.tool_id, e.name) for e in events if type(e).__name__ == "Opened"]
    assert opened == [("toolu_1", "a"), ("toolu_2", "b")]
    texts = [e.text for e in events if type(e).__name__ == "Added"]
    assert texts == ['{"x"', ": 1}", "{}"]  # a call with no arguments has input {}


def test_return_token_ids_at_the_ends_of_the_stream_and_in_the_whole_message() -> None:
    ids_config = replace(CONFIG, prompt_token_ids=(1, 2, 3), reused_prompt_tokens=3)
    deltas = (
        ChoiceDelta(index=0, content="he", token_ids=(7,)),
        ChoiceDelta(index=0, content="y", finish=FinishCause.EOS, token_ids=(8, 9)),
    )
    encoder = MessageStreamEncoder(ids_config)
    frames = encoder.start() + encoder.encode(Deltas(deltas=deltas))
    frames += encoder.encode(Completed(usage=Usage(prompt_tokens=3, completion_tokens=3)))
    events = [
        json.loads(line[6:]) for line in frames.decode().splitlines() if line.startswith("data: ")
    ]
    start = next(e["message"] for e in events if e["type"] == "message_start")
    delta = next(e["delta"] for e in events if e["type"] == "message_delta")
    assert (start["prompt_token_ids"], start["reused_prompt_tokens"]) == ([1, 2, 3], 3)
    assert delta["generation_token_ids"] == [7, 8, 9]
    whole = MessageAccumulator(ids_config)
    whole.add(Deltas(deltas=deltas))
    whole.add(Completed(usage=Usage(prompt_tokens=3, completion_tokens=3)))
    message = json.loads(whole.to_json())
    assert message["prompt_token_ids"] == [1, 2, 3]
    assert message["generation_token_ids"] == [7, 8, 9]
    assert message["reused_prompt_tokens"] == 3
    plain = MessageAccumulator(CONFIG)
    plain.add(Deltas(deltas=deltas))
    plain.add(Completed(usage=Usage(prompt_tokens=3, completion_tokens=3)))
    assert "generation_token_ids" not in json.loads(plain.to_json())
