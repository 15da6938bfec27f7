"""The output actor's token path (the tokens surface): every id goes out in
the step that produced it, with exactly its entry; stop strings end a choice
where they complete, their tokens' ids included."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sluiceway.actors.output import OutputConfig, RequestOutputs
from sluiceway.parsers.registry import TextPathOptions, build_pipeline
from sluiceway.protocol.messages import (
    ChoiceDelta,
    Completed,
    Deltas,
    EmitterEvent,
    FinishCause,
    StepOutput,
    TokenLogprob,
    TokenSample,
    Usage,
)
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces.tokens.encoder import (
    GenerateAccumulator,
    GenerateReplyConfig,
    GenerateStreamEncoder,
)
from tests.parsers.harness import Tokenized, examples, tokenizations

EOS, STOP_ID = 0, 9
#: "Caf" "é" split over two tokens, " S" "TO" "P!" (the stop string STOP over three).
TABLE = TokenTable(
    (b"<eos>", b"Caf", b"\xc3", b"\xa9", b" S", b"TO", b"P!", b"ab", b"abc", b"<stop>"),
    frozenset({EOS, STOP_ID}),
)


class Finisher:
    def __init__(self) -> None:
        self.finished: list[tuple[str, int]] = []

    def finish_choice(self, request_id: str, choice: int) -> None:
        self.finished.append((request_id, choice))


def outputs(stop: tuple[str, ...] = (), *, n: int = 1, logprobs: bool = True) -> RequestOutputs:
    config = OutputConfig(
        request_id="g1",
        n=n,
        prompt_ids=(7, 8),
        table=TABLE,
        make_pipeline=lambda: build_pipeline(TABLE, TextPathOptions(stop=stop)),
        logprobs=logprobs,
        ids_only=True,
    )
    return RequestOutputs(config, Finisher())


def sample(token_id: int, choice: int = 0, finish: FinishCause | None = None) -> TokenSample:
    return TokenSample(
        choice=choice,
        token_id=token_id,
        logprob=TokenLogprob(logprob=-float(token_id), top=((token_id, -float(token_id)),)),
        finish=finish,
    )


def deltas_of(events: list[EmitterEvent]) -> list[ChoiceDelta]:
    return [d for e in events if isinstance(e, Deltas) for d in e.deltas]


def test_every_id_goes_out_in_its_own_step_with_exactly_its_entry() -> None:
    core = outputs()
    script = [1, 2, 3, 4]  # a character split over ids 2 and 3 holds nothing back
    for token_id in script:
        (delta,) = deltas_of(core.handle(StepOutput(samples=(sample(token_id),))))
        assert delta.token_ids == (token_id,)
        assert delta.logprobs is not None
        assert [e.token_id for e in delta.logprobs.content] == [token_id]
        assert delta.logprobs.content[0].logprob == -float(token_id)
        assert (delta.content, delta.reasoning, delta.finish) == ("", "", None)
    (last,) = deltas_of(core.handle(StepOutput(samples=(sample(EOS, finish=FinishCause.EOS),))))
    assert (last.token_ids, last.finish, last.matched_stop) == ((EOS,), FinishCause.EOS, None)
    assert core.close() == [Completed(usage=Usage(prompt_tokens=2, completion_tokens=5))]


def test_no_entries_when_none_were_asked_for() -> None:
    core = outputs(logprobs=False)
    (delta,) = deltas_of(core.handle(StepOutput(samples=(sample(1),))))
    assert (delta.token_ids, delta.logprobs) == ((1,), None)


def test_a_stop_string_ends_the_choice_at_the_token_that_completes_it() -> None:
    finisher = Finisher()
    config = OutputConfig(
        request_id="g1",
        n=2,
        prompt_ids=(7,),
        table=TABLE,
        make_pipeline=lambda: build_pipeline(TABLE, TextPathOptions(stop=("STOP",))),
        logprobs=False,
        ids_only=True,
    )
    core = RequestOutputs(config, finisher)
    events: list[EmitterEvent] = []
    for token_id in (1, 4, 5, 6, 1):
        events += core.handle(StepOutput(samples=(sample(token_id), sample(7, choice=1))))
    assert finisher.finished == [("g1", 0)]
    events += core.close()
    deltas = deltas_of(events)
    ids = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in (0, 1)}
    # The stop string's tokens are generated tokens: their ids stay; the one
    # after the stop was never part of the choice.
    assert ids == {0: [1, 4, 5, 6], 1: [7] * 5}
    finishes = {d.index: (d.finish, d.matched_stop, d.token_ids) for d in deltas if d.finish}
    assert finishes == {
        0: (FinishCause.STOP_STRING, "STOP", (6,)),
        1: (FinishCause.CANCELLED, None, ()),
    }
    assert events[-1] == Completed(usage=Usage(prompt_tokens=1, completion_tokens=9))


def test_the_first_completed_stop_string_ends_the_choice_on_its_token() -> None:
    """ "bc" completes inside "abc" while "abcd" could still match: the
    choice ends on that token, with "bc" as the stop, as OpenAI's API ends it."""
    core = outputs(("abcd", "bc"))
    (delta,) = deltas_of(core.handle(StepOutput(samples=(sample(8),))))
    assert (delta.token_ids, delta.finish, delta.matched_stop) == (
        (8,),
        FinishCause.STOP_STRING,
        "bc",
    )


def test_a_stop_token_id_is_the_matched_stop() -> None:
    core = outputs(("STOP",))
    events = core.handle(StepOutput(samples=(sample(STOP_ID, finish=FinishCause.STOP_TOKEN),)))
    (delta,) = deltas_of(events)
    assert (delta.token_ids, delta.finish, delta.matched_stop) == (
        (STOP_ID,),
        FinishCause.STOP_TOKEN,
        STOP_ID,
    )


@st.composite
def generations(draw: st.DrawFn) -> tuple[Tokenized, tuple[str, ...], int, list[list[int]]]:
    """A document split into random tokens, stop strings from it (or none),
    and how ``n`` choices' tokens arrive step by step (each choice its own
    copy of the document, starting at a random offset)."""
    text = draw(st.text(st.sampled_from(list("ab é€STOP")), min_size=1, max_size=24))
    tokenized = draw(tokenizations(text, eos=True))
    stops: tuple[str, ...] = ()
    if draw(st.booleans()):
        start = draw(st.integers(0, len(text) - 1))
        stops = (
            text[start : start + draw(st.integers(1, 3))],
            *draw(st.lists(st.sampled_from(["STOP", "é", "b a"]), max_size=2)),
        )
    n = draw(st.integers(1, 3))
    offsets = [draw(st.integers(0, len(tokenized.ids) - 1)) for _ in range(n)]
    return tokenized, stops, n, [list(tokenized.ids[o:]) for o in offsets]


def ending(table: TokenTable, ids: list[int], stops: tuple[str, ...]) -> tuple[int, bool]:
    """How many of ``ids`` a choice takes, and whether a stop string ended
    it: up to the first token whose text completes a stop string, or the
    first EOS, whichever comes first (an incomplete character at the end of
    the text completes none)."""
    for length in range(1, len(ids) + 1):
        if any(stop in table.decode(ids[:length]) for stop in stops):
            return length, True
        if ids[length - 1] in table.hidden:
            return length, False
    return len(ids), False


#: Overlapping stop strings: "é" completes in token 2 while "OéO", which
#: started earlier, might still complete; the choice ends on token 2.
OVERLAPPING = (
    Tokenized(TokenTable((b"O", b"\xc3", b"\xa9", b"<|im_end|>"), frozenset({3})), (0, 1, 2, 0, 3)),
    ("OéO", "é"),
    1,
    [[0, 1, 2, 0, 3]],
)


@settings(max_examples=examples(200), deadline=None)
@given(case=generations(), logprobs=st.booleans())
@example(case=OVERLAPPING, logprobs=False)
def test_streamed_ids_are_the_whole_replys_ids(
    case: tuple[Tokenized, tuple[str, ...], int, list[list[int]]], logprobs: bool
) -> None:
    tokenized, stops, n, scripts = case
    table = tokenized.table
    config = OutputConfig(
        request_id="g",
        n=n,
        prompt_ids=(0,),
        table=table,
        make_pipeline=lambda: build_pipeline(table, TextPathOptions(stop=stops)),
        logprobs=logprobs,
        ids_only=True,
    )
    core = RequestOutputs(config, Finisher())
    reply = GenerateReplyConfig(reply_id="g", created=1, model="m", n=n, logprobs=logprobs)
    stream, whole = GenerateStreamEncoder(reply), GenerateAccumulator(reply)
    frames = b""
    eos = table.hidden
    for position in range(max(map(len, scripts))):
        samples = tuple(
            TokenSample(
                choice=c,
                token_id=ids[position],
                logprob=TokenLogprob(logprob=-0.25 * ids[position]),
                finish=FinishCause.EOS if ids[position] in eos else None,
            )
            for c, ids in enumerate(scripts)
            if position < len(ids)
        )
        for event in core.handle(StepOutput(samples=samples)):
            frames += stream.encode(event)
            whole.add(event)
    for event in core.close():
        frames += stream.encode(event)
        whole.add(event)
    chunks = [json.loads(f[6:]) for f in frames.split(b"\n\n") if f.startswith(b"data: {")]
    reply_json = json.loads(whole.to_json())
    for choice in reply_json["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        for c in mine:
            if logprobs and c["token_ids"]:
                assert [e["token"] for e in c["logprobs"]["content"]] == [
                    f"token_id:{t}" for t in c["token_ids"]
                ]
        # The ids are the script's, up to where the choice ended: EOS, or the
        # token that completed the first stop string, not one token later.
        length, stopped = ending(table, scripts[choice["index"]], stops)
        assert choice["token_ids"] == scripts[choice["index"]][:length]
        assert (choice["matched_stop"] is not None) == stopped, choice
        if stopped:
            assert choice["matched_stop"] in stops
            assert choice["matched_stop"] in table.decode(choice["token_ids"])
    assert reply_json["usage"]["completion_tokens"] == sum(
        len(c["token_ids"]) for c in reply_json["choices"]
    )
