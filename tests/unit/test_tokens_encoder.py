"""The generate encoder: template frames equal the models', the whole reply
is the stream's deltas merged, and vLLM's spellings (``token_id:N``, the
prompt logprobs' shape, ``abort``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    Completed,
    Deltas,
    EmitterEvent,
    FinishCause,
    LogprobEntry,
    PromptLogprobs,
    Usage,
)
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces.tokens.encoder import (
    GenerateAccumulator,
    GenerateReplyConfig,
    GenerateStreamEncoder,
)


def config(**fields: Any) -> GenerateReplyConfig:
    defaults: dict[str, Any] = {"reply_id": 'r"1', "created": 5, "model": "m", "n": 2}
    return GenerateReplyConfig(**{"logprobs": False, **defaults, **fields})


#: Id 4 is "y", every other id "x".
VOCABULARY = TokenTable((b"x",) * 4 + (b"y",) + (b"x",) * 5, frozenset())


def entry(token_id: int, top: tuple[int, ...] = (), rank: int | None = None) -> LogprobEntry:
    token, raw = VOCABULARY.entry_parts(token_id)
    return LogprobEntry(
        token=token,
        token_id=token_id,
        logprob=-float(token_id),
        bytes=raw,
        vocabulary=VOCABULARY,
        top=tuple((t, -0.5 * t) for t in top),
        rank=rank,
    )


def frames(encoder: GenerateStreamEncoder, events: list[EmitterEvent]) -> list[Any]:
    data = b"".join(encoder.encode(event) for event in events).decode()
    assert data.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in data.split("\n\n") if line.startswith("data: {")]


@given(
    ids=st.lists(st.integers(0, 10**6), max_size=4),
    index=st.integers(0, 1),
    usage=st.booleans(),
    reply_id=st.text(),
)
def test_id_frames_match_the_models(ids: list[int], index: int, usage: bool, reply_id: str) -> None:
    delta = ChoiceDelta(index=index, token_ids=tuple(ids))
    fast = GenerateStreamEncoder(config(include_usage=usage, reply_id=reply_id))
    slow = GenerateStreamEncoder(config(include_usage=usage, reply_id=reply_id))
    slow._frame = lambda d: slow._chunk([_model_choice(d)])  # type: ignore[method-assign]
    framed = fast.encode(Deltas(deltas=(delta,)))
    assert framed.startswith(b"data: ")
    assert framed.index(b"\n") == len(framed) - 2
    assert json.loads(framed[6:]) == json.loads(slow.encode(Deltas(deltas=(delta,)))[6:])


def _model_choice(delta: ChoiceDelta) -> Any:
    from sluiceway.surfaces.tokens.wire import GenerateChunkChoiceWire

    return GenerateChunkChoiceWire(
        index=delta.index, token_ids=list(delta.token_ids), logprobs=None, finish_reason=None
    )


def test_the_whole_reply_is_the_stream_merged() -> None:
    events: list[EmitterEvent] = [
        PromptLogprobs(entries=(None, entry(3, top=(4, 3), rank=2)), n=2),
        Deltas(
            deltas=(
                ChoiceDelta(index=0, token_ids=(1,), logprobs=ChoiceLogprobs(content=(entry(1),))),
                ChoiceDelta(index=1, token_ids=(2,), logprobs=ChoiceLogprobs(content=(entry(2),))),
            )
        ),
        Deltas(
            deltas=(
                ChoiceDelta(
                    index=0,
                    token_ids=(5,),
                    logprobs=ChoiceLogprobs(content=(entry(5, top=(5, 6)),)),
                    finish=FinishCause.STOP_STRING,
                    matched_stop="END",
                ),
                ChoiceDelta(
                    index=1,
                    token_ids=(6,),
                    logprobs=ChoiceLogprobs(content=(entry(6),)),
                    finish=FinishCause.MAX_TOKENS,
                ),
            )
        ),
        Completed(usage=Usage(prompt_tokens=2, completion_tokens=4, cached_tokens=1)),
    ]
    reply_config = config(logprobs=True, prompt_logprobs=True, include_usage=True)
    chunks = frames(GenerateStreamEncoder(reply_config), events)
    accumulator = GenerateAccumulator(reply_config)
    for event in events:
        accumulator.add(event)
    whole = json.loads(accumulator.to_json())
    assert whole["object"] == "generate"
    assert whole["id"] == whole["request_id"] == 'r"1'
    for index, choice in enumerate(whole["choices"]):
        streamed = [c["choices"][0] for c in chunks if c["choices"]]
        mine = [c for c in streamed if c["index"] == index]
        assert choice["token_ids"] == [t for c in mine for t in c["token_ids"]]
        assert choice["logprobs"]["content"] == [e for c in mine for e in c["logprobs"]["content"]]
        # Every streamed id has exactly its entry, in the same event.
        for c in mine:
            assert [e["token"] for e in c["logprobs"]["content"]] == [
                f"token_id:{t}" for t in c["token_ids"]
            ]
    assert [(c["finish_reason"], c["matched_stop"]) for c in whole["choices"]] == [
        ("stop", "END"),
        ("length", None),
    ]
    assert whole["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    # vLLM's prompt logprobs: per position the prompt token (with its rank)
    # first, then the top alternatives that are not it, ranked from 1.
    assert whole["prompt_logprobs"] == [
        None,
        {
            "3": {"logprob": -3.0, "rank": 2, "decoded_token": "x"},
            "4": {"logprob": -2.0, "rank": 1, "decoded_token": "y"},
        },
    ]
    assert chunks[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert all("prompt_logprobs" not in c for c in chunks[1:])


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        (FinishCause.EOS, "stop"),
        (FinishCause.STOP_TOKEN, "stop"),
        (FinishCause.STOP_STRING, "stop"),
        (FinishCause.MAX_TOKENS, "length"),
        (FinishCause.CANCELLED, "abort"),
    ],
)
def test_finish_reasons(cause: FinishCause, reason: str) -> None:
    last = ChoiceDelta(index=0, finish=cause)
    (chunk,) = frames(
        GenerateStreamEncoder(config()),
        [Deltas(deltas=(last,)), Completed(usage=Usage(prompt_tokens=1, completion_tokens=0))],
    )
    assert chunk["choices"][0]["finish_reason"] == reason
