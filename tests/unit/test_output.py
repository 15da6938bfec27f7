"""The output actor's per-choice path: entries ride the chunk carrying their
text; and its request-level core: stops, the end of a request, failures."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from sluiceway.actors.output import ChoiceOutput, EntryFactory, OutputConfig, RequestOutputs
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.parsers.registry import TextPathOptions, build_pipeline
from sluiceway.protocol.messages import (
    ChoiceDelta,
    Completed,
    Deltas,
    Failed,
    FinishCause,
    RequestFailed,
    StepOutput,
    TokenLogprob,
    TokenSample,
    Usage,
)
from sluiceway.protocol.tokens import TokenTable

EOS = 0


@st.composite
def tokenised(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    text = draw(st.text(st.characters(codec="utf-8"), min_size=0, max_size=30))
    data = text.encode("utf-8")
    cuts = draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data)))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return text, [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def run(pieces: list[bytes]) -> list[ChoiceDelta]:
    # id 0 is EOS (hidden); piece i is id i + 1.
    table = TokenTable((b"<eos>", *pieces), frozenset({EOS}))
    choice = ChoiceOutput(
        index=0,
        pipeline=ChoicePipeline(table),
        entries=EntryFactory(table),
        with_logprobs=True,
        include_stop_token_text=False,
    )
    deltas: list[ChoiceDelta] = []
    for position in range(len(pieces)):
        sample = TokenSample(
            choice=0, token_id=position + 1, logprob=TokenLogprob(logprob=-float(position))
        )
        produced, stopped = choice.take(sample)
        assert not stopped
        deltas += produced
    finish = TokenSample(
        choice=0, token_id=EOS, logprob=TokenLogprob(logprob=-0.5), finish=FinishCause.EOS
    )
    produced, _ = choice.take(finish)
    return deltas + produced


@given(tokenised())
@example(("é", [b"\xc3", b"\xa9"]))
@example(("a€b", [b"a\xe2", b"\x82", b"\xacb"]))
def test_entries_are_exact_and_travel_with_their_text(case: tuple[str, list[bytes]]) -> None:
    text, pieces = case
    deltas = run(pieces)
    assert "".join(d.content for d in deltas) == text
    entries = [e for d in deltas if d.logprobs for e in d.logprobs.content]
    assert len(entries) == len(pieces) + 1  # every token once, EOS included
    assert [e.logprob for e in entries[:-1]] == [-float(i) for i in range(len(pieces))]
    assert bytes(b for e in entries for b in e.bytes) == text.encode() + b"<eos>"
    assert deltas[-1].finish is FinishCause.EOS
    consumed = b""
    for delta in deltas:
        assert delta.logprobs is not None
        carried = b"".join(bytes(e.bytes) for e in delta.logprobs.content if e.token_id != EOS)
        consumed += carried
        # Entries never run behind the text (every released character's
        # token has been sent) and never ahead by more than one token's
        # unfinished character.
        released = "".join(d.content for d in deltas[: deltas.index(delta) + 1]).encode()
        assert consumed.startswith(released)
        assert text.encode().startswith(consumed) or delta is deltas[-1]
        assert len(consumed) - len(released) < 4 or delta is deltas[-1]
        assert all(offset <= len(delta.content) for offset in delta.logprobs.content_offsets)


class Finisher:
    def __init__(self) -> None:
        self.finished: list[tuple[str, int]] = []

    def finish_choice(self, request_id: str, choice: int) -> None:
        self.finished.append((request_id, choice))


def request_outputs(finisher: Finisher, n: int = 2) -> RequestOutputs:
    table = TokenTable((b"<eos>", b"ab", b"c", b"STOP", b"d"), frozenset({EOS}))
    config = OutputConfig(
        request_id="r1",
        n=n,
        prompt_ids=(1, 2, 3),
        table=table,
        make_pipeline=lambda: build_pipeline(table, TextPathOptions(stop=("STOP",))),
        logprobs=False,
    )
    return RequestOutputs(config, finisher)


def step(*samples: tuple[int, int]) -> StepOutput:
    return StepOutput(
        samples=tuple(TokenSample(choice=c, token_id=t, logprob=None) for c, t in samples)
    )


def test_a_stop_string_finishes_its_choice_and_the_end_cuts_off_the_rest() -> None:
    finisher = Finisher()
    outputs = request_outputs(finisher)
    events = outputs.handle(step((0, 1), (1, 2)))
    events += outputs.handle(step((0, 3), (1, 4)))
    assert finisher.finished == [("r1", 0)]
    events += outputs.close()
    assert outputs.ended
    assert outputs.close() == []
    assert outputs.handle(step((1, 2))) == []
    deltas = [d for e in events if isinstance(e, Deltas) for d in e.deltas]
    text = {i: "".join(d.content for d in deltas if d.index == i) for i in (0, 1)}
    assert text == {0: "ab", 1: "cd"}
    finishes = {d.index: (d.finish, d.matched_stop) for d in deltas if d.finish}
    assert finishes == {0: (FinishCause.STOP_STRING, "STOP"), 1: (FinishCause.CANCELLED, None)}
    assert events[-1] == Completed(usage=Usage(prompt_tokens=3, completion_tokens=4))


def test_a_failure_ends_the_output_without_usage() -> None:
    outputs = request_outputs(Finisher(), n=1)
    assert outputs.handle(step((0, 1))) == [Deltas(deltas=(ChoiceDelta(index=0, content="ab"),))]
    assert outputs.handle(RequestFailed(message="engine died")) == [Failed(message="engine died")]
    assert outputs.ended
    assert outputs.close() == []
