"""The Responses encoders, from neutral deltas: any document, cut into deltas
anywhere, streams as a well-formed event stream (the order agents depend
on, every event valid by the published schemas and the SDK's types) whose
items equal the whole reply's; the template-framed deltas are exactly what
the models would frame."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    Completed,
    Deltas,
    Failed,
    FinishCause,
    LogprobEntry,
    ToolCallDelta,
    Usage,
)
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces.responses.encoder import (
    ReplyConfig,
    ResponsesAccumulator,
    ResponsesStreamEncoder,
)
from sluiceway.surfaces.responses.reply_wire import CallDeltaEvent, TextDeltaEvent
from sluiceway.surfaces.responses.tools import ToolRef, ToolTable
from tests.e2e.responses_wire import check_response, check_stream, parse_sse, without_ids

TOOLS = ToolTable(
    refs={
        "get_weather": ToolRef(name="get_weather"),
        "ns__wait": ToolRef(name="wait", namespace="ns"),
        "apply_patch": ToolRef(name="apply_patch", custom=True),
    }
)
USAGE = Usage(prompt_tokens=5, completion_tokens=9, reasoning_tokens=2)


def config(logprobs: bool = True) -> ReplyConfig:
    return ReplyConfig(
        response_id="resp_1",
        created_at=7,
        model='m"odel',
        tools=TOOLS,
        logprobs=logprobs,
        echo={
            "instructions": None,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "temperature": 0.0,
            "top_p": 1.0,
            "max_output_tokens": None,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "text": {"format": {"type": "text"}},
            "metadata": {},
            "store": False,
        },
    )


def entry(text: str) -> LogprobEntry:
    vocabulary = TokenTable((b"", text.encode()), frozenset())
    token, data = vocabulary.entry_parts(1)
    return LogprobEntry(
        token=token, token_id=1, logprob=-0.25, bytes=data, vocabulary=vocabulary, top=((1, -0.5),)
    )


# A piece of a document: reasoning or content text, a call's name, or arguments.
Piece = tuple[str, str]

texts = st.text(alphabet=st.sampled_from('ab é€"\\\n\t\x00<>{}'), min_size=1, max_size=6)


@st.composite
def documents(draw: st.DrawFn) -> list[Piece]:
    """Reasoning, content, calls -- and sometimes content after the calls."""
    pieces: list[Piece] = [("reasoning", t) for t in draw(st.lists(texts, max_size=3))]
    pieces += [("content", t) for t in draw(st.lists(texts, max_size=3))]
    for name in draw(st.lists(st.sampled_from(["get_weather", "ns__wait", "apply_patch", "x"]))):
        pieces.append(("call", name))
        pieces += [("arguments", t) for t in draw(st.lists(texts, max_size=3))]
    pieces += [("content", t) for t in draw(st.lists(texts, max_size=2))]
    return pieces


_ORDER = {"reasoning": 0, "content": 1, "call": 2, "arguments": 2}


def cut(pieces: list[Piece], cuts: list[bool], finish: FinishCause) -> list[ChoiceDelta]:
    """The pieces as deltas: a new delta where ``cuts`` says, and wherever a
    delta could not hold the next piece (a delta's text comes in the order
    reasoning, content, tool calls)."""
    groups: list[list[Piece]] = []
    for piece, new in zip(pieces, cuts + [False] * len(pieces), strict=False):
        last = groups[-1][-1][0] if groups else None
        if not groups or new or (last is not None and _ORDER[piece[0]] < _ORDER[last]):
            groups.append([])
        groups[-1].append(piece)
    deltas = [_delta(group) for group in groups]
    # The last delta carries the finish, and entries of tokens with no text.
    final = ChoiceLogprobs(content=(entry("<|im_end|>"),))
    return [*deltas, ChoiceDelta(index=0, logprobs=final, finish=finish)]


def _delta(group: list[Piece]) -> ChoiceDelta:
    calls: list[ToolCallDelta] = []
    reasoning = content = ""
    for kind, text in group:
        if kind == "reasoning":
            reasoning += text
        elif kind == "content":
            content += text
        elif kind == "call":
            calls.append(ToolCallDelta(index=0, arguments="", name=text))
        elif calls:
            last = calls[-1]
            calls[-1] = ToolCallDelta(
                index=last.index, arguments=last.arguments + text, name=last.name
            )
        else:
            calls.append(ToolCallDelta(index=0, arguments=text))
    entries = tuple(entry(content[i : i + 2]) for i in range(0, len(content), 2))
    logprobs = ChoiceLogprobs(content=entries) if entries else None
    return ChoiceDelta(
        index=0, reasoning=reasoning, content=content, tool_calls=tuple(calls), logprobs=logprobs
    )


def numbered(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """Tool call indices as the parsers give them: 0, 1, ... in order; a
    fragment without a name continues the latest call."""
    count = -1
    out = []
    for delta in deltas:
        calls = []
        for call in delta.tool_calls:
            if call.name is not None:
                count += 1
            calls.append(
                ToolCallDelta(index=max(count, 0), arguments=call.arguments, name=call.name)
            )
        out.append(
            ChoiceDelta(
                index=0,
                reasoning=delta.reasoning,
                content=delta.content,
                tool_calls=tuple(calls),
                logprobs=delta.logprobs,
                finish=delta.finish,
            )
        )
    return out


def drive(deltas: list[ChoiceDelta], logprobs: bool = True) -> tuple[bytes, dict[str, Any]]:
    encoder = ResponsesStreamEncoder(config(logprobs))
    accumulator = ResponsesAccumulator(config(logprobs))
    frames = encoder.start()
    for event in (Deltas(deltas=(delta,)) for delta in deltas):
        frames += encoder.encode(event)
        accumulator.add(event)
    frames += encoder.encode(Completed(usage=USAGE))
    accumulator.add(Completed(usage=USAGE))
    return frames, json.loads(accumulator.to_json())


@given(
    pieces=documents(),
    cuts=st.lists(st.booleans(), max_size=40),
    finish=st.sampled_from([FinishCause.EOS, FinishCause.MAX_TOKENS, FinishCause.STOP_TOKEN]),
    logprobs=st.booleans(),
)
@settings(deadline=None)  # the SDK's event union is slow to validate
@example(pieces=[("content", "a")], cuts=[], finish=FinishCause.EOS, logprobs=True)
@example(pieces=[], cuts=[], finish=FinishCause.MAX_TOKENS, logprobs=False)
def test_any_cut_streams_well_formed_and_equals_the_whole_reply(
    pieces: list[Piece], cuts: list[bool], finish: FinishCause, logprobs: bool
) -> None:
    deltas = numbered(cut(pieces, cuts, finish))
    frames, whole = drive(deltas, logprobs)
    final = check_stream(parse_sse(frames.decode()))
    check_response(whole)
    assert without_ids(final["output"]) == without_ids(whole["output"])
    status = "incomplete" if finish is FinishCause.MAX_TOKENS else "completed"
    assert final["status"] == whole["status"] == status
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    # Text by kind, in order: what the deltas carried.
    items = whole["output"]
    reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
    assert reasoning == "".join(t for k, t in pieces if k == "reasoning")
    messages = [i for i in items if i["type"] == "message"]
    content = "".join(p["text"] for i in messages for p in i["content"])
    assert content == "".join(t for k, t in pieces if k == "content")
    if logprobs and messages:
        entries = [e["token"] for i in messages for p in i["content"] for e in p["logprobs"]]
        if items[-1]["type"] == "message":
            # The final delta's entry of a token with no text joins the open message.
            assert entries.pop() == "<|im_end|>"
        assert "".join(entries) == content
    calls = [i for i in items if i["type"] in ("function_call", "custom_tool_call")]
    assert [c["name"] for c in calls] == [
        {"ns__wait": "wait"}.get(name, name) for kind, name in pieces if kind == "call"
    ]
    for call in calls:
        if call["name"] == "wait":
            assert call["namespace"] == "ns"
        else:
            assert "namespace" not in call
        assert (call["type"] == "custom_tool_call") == (call["name"] == "apply_patch")
    # The token limit cuts off the last item only.
    assert [i["status"] for i in items] == ["completed"] * (len(items) - 1) + [status][: len(items)]


@given(text=st.text(), item=st.sampled_from(["content", "reasoning", "arguments"]))
def test_template_frames_are_what_the_models_frame(text: str, item: str) -> None:
    delta = {
        "content": ChoiceDelta(
            index=0, content=text or "x", logprobs=ChoiceLogprobs(content=(entry(text),))
        ),
        "reasoning": ChoiceDelta(index=0, reasoning=text or "x"),
        "arguments": ChoiceDelta(
            index=0, tool_calls=(ToolCallDelta(index=0, arguments=text or "x", name="get_weather"),)
        ),
    }[item]
    encoder = ResponsesStreamEncoder(config())
    encoder.start()
    frames = encoder.encode(Deltas(deltas=(delta,)))
    blocks = [b for b in frames.split(b"\n\n") if b.count(b"delta") and b"_item.added" not in b]
    assert len(blocks) == 1
    data = blocks[0].split(b"\ndata: ", 1)[1]
    model = CallDeltaEvent if item == "arguments" else TextDeltaEvent
    assert data.decode() == model.model_validate_json(data).to_json()


def test_a_custom_call_comes_back_with_its_input() -> None:
    deltas = [
        ChoiceDelta(
            index=0,
            tool_calls=(ToolCallDelta(index=0, arguments='{"input": "*** B', name="apply_patch"),),
        ),
        ChoiceDelta(index=0, tool_calls=(ToolCallDelta(index=0, arguments='egin\\n"}'),)),
        ChoiceDelta(index=0, finish=FinishCause.EOS, called_tools=True),
    ]
    frames, whole = drive(deltas)
    events = parse_sse(frames.decode())
    check_stream(events)
    [call] = whole["output"]
    assert call["type"] == "custom_tool_call"
    assert call["input"] == "*** Begin\n"
    kinds = [e["type"] for e in events]
    assert kinds.count("response.custom_tool_call_input.delta") == 1
    assert "response.function_call_arguments.delta" not in kinds


def test_custom_input_that_is_not_the_offered_shape_comes_back_as_written() -> None:
    deltas = [
        ChoiceDelta(
            index=0, tool_calls=(ToolCallDelta(index=0, arguments="[1, 2", name="apply_patch"),)
        ),
        ChoiceDelta(index=0, finish=FinishCause.EOS, called_tools=True),
    ]
    _, whole = drive(deltas)
    assert whole["output"][0]["input"] == "[1, 2"


def test_a_failure_mid_stream_ends_it_with_response_failed() -> None:
    encoder = ResponsesStreamEncoder(config())
    frames = encoder.start() + encoder.encode(Deltas(deltas=(ChoiceDelta(index=0, content="hi"),)))
    frames += encoder.encode(Failed(message="the engine died"))
    events = parse_sse(frames.decode())
    final = check_stream(events)
    assert final["status"] == "failed"
    assert final["error"] == {"code": "server_error", "message": "the engine died"}


def test_a_cancelled_choice_is_a_failure() -> None:
    accumulator = ResponsesAccumulator(config())
    accumulator.add(
        Deltas(deltas=(ChoiceDelta(index=0, content="hi", finish=FinishCause.CANCELLED),))
    )
    accumulator.add(Completed(usage=USAGE))
    assert accumulator.failure is not None
    encoder = ResponsesStreamEncoder(config())
    frames = encoder.start()
    frames += encoder.encode(
        Deltas(deltas=(ChoiceDelta(index=0, content="hi", finish=FinishCause.CANCELLED),))
    )
    frames += encoder.encode(Completed(usage=USAGE))
    assert check_stream(parse_sse(frames.decode()))["status"] == "failed"


def test_every_event_has_an_event_line_and_counts_from_zero() -> None:
    frames, _ = drive(
        [ChoiceDelta(index=0, content="a"), ChoiceDelta(index=0, finish=FinishCause.EOS)]
    )
    names = re.findall(rb"^event: (\S+)$", frames, re.M)
    numbers = [int(n) for n in re.findall(rb'"sequence_number":(\d+)', frames)]
    assert numbers == list(range(len(names)))


def test_keepalive_is_a_comment() -> None:
    assert ResponsesStreamEncoder(config()).keepalive().startswith(b":")


@pytest.mark.parametrize("logprobs", [True, False])
def test_the_eos_entry_rides_an_empty_delta_only_with_logprobs(logprobs: bool) -> None:
    deltas = [
        ChoiceDelta(index=0, content="hi", logprobs=ChoiceLogprobs(content=(entry("hi"),))),
        ChoiceDelta(
            index=0, logprobs=ChoiceLogprobs(content=(entry("<|im_end|>"),)), finish=FinishCause.EOS
        ),
    ]
    frames, _ = drive(deltas, logprobs)
    deltas_out = [
        e for e in parse_sse(frames.decode()) if e["type"] == "response.output_text.delta"
    ]
    assert [e["delta"] for e in deltas_out] == (["hi", ""] if logprobs else ["hi"])


def test_the_turns_ids_ride_on_its_last_item_only() -> None:
    """``return_token_ids``: the item the end closes carries the prompt's ids
    and every generated id (those of earlier deltas too), in the stream's
    last ``output_item.done`` and in both whole replies."""
    ids_config = replace(config(logprobs=False), prompt_token_ids=(1, 2), reused_prompt_tokens=2)
    deltas = [
        ChoiceDelta(index=0, reasoning="hm", token_ids=(10, 11)),
        ChoiceDelta(
            index=0,
            tool_calls=(ToolCallDelta(index=0, name="get_weather", arguments="{}"),),
            token_ids=(12,),
        ),
        ChoiceDelta(index=0, finish=FinishCause.EOS, called_tools=True, token_ids=(13,)),
    ]
    encoder = ResponsesStreamEncoder(ids_config)
    accumulator = ResponsesAccumulator(ids_config)
    frames = encoder.start() + encoder.encode(Deltas(deltas=tuple(deltas)))
    frames += encoder.encode(Completed(usage=USAGE))
    for delta in deltas:
        accumulator.add(Deltas(deltas=(delta,)))
    accumulator.add(Completed(usage=USAGE))
    events = parse_sse(frames.decode())
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    expected = {"prompt_token_ids": [1, 2], "generation_token_ids": [10, 11, 12, 13]}
    for items in (
        done,
        events[-1]["response"]["output"],
        json.loads(accumulator.to_json())["output"],
    ):
        reasoning, call = items
        assert "prompt_token_ids" not in reasoning
        assert {k: call[k] for k in expected} == expected
    assert json.loads(accumulator.to_json())["reused_prompt_tokens"] == 2
    assert all(e["response"]["reused_prompt_tokens"] == 2 for e in events if "response" in e)


def test_without_return_token_ids_no_item_carries_ids() -> None:
    accumulator = ResponsesAccumulator(config(logprobs=False))
    accumulator.add(Deltas(deltas=(ChoiceDelta(index=0, content="x", finish=FinishCause.EOS),)))
    accumulator.add(Completed(usage=USAGE))
    reply = json.loads(accumulator.to_json())
    assert "reused_prompt_tokens" not in reply
    assert "generation_token_ids" not in reply["output"][0]
