"""The output actor's token path (the tokens surface): every id goes out in
the step that produced it, with exactly its entry; stop strings end a choice
where they complete, their tokens' ids included."""

from __future__ import annotations

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


def test_a_pending_shorter_stop_string_wins_when_the_output_ends() -> None:
    """ "bc" completes inside "abc" while "abcd" could still match; EOS ends
    the output, so "bc" is the stop that ended the choice."""
    core = outputs(("abcd", "bc"))
    events = core.handle(StepOutput(samples=(sample(8),)))
    assert [d.finish for d in deltas_of(events)] == [None]
    events = core.handle(StepOutput(samples=(sample(EOS, finish=FinishCause.EOS),)))
    (delta,) = deltas_of(events)
    assert (delta.token_ids, delta.finish, delta.matched_stop) == (
        (EOS,),
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
