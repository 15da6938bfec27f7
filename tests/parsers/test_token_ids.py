"""``return_token_ids`` on the text path: the ownership rule (docs/alignment.md,
guarantee 3b) over random documents, tokenisations and chunkings, with
reasoning, tool calls, stop strings and EOS.

The output actor's per-choice core (``ChoiceOutput``) runs a recording
pipeline, so each delta it produces can be matched with the chunk it came
from, and what the chunks carry is read from the harness's independent
bookkeeping (first characters, markup, watermarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import example, given, settings

from sluiceway.actors.output import ChoiceOutput, EntryFactory
from sluiceway.parsers.assembler import Chunk
from sluiceway.parsers.pipeline import ChoicePipeline, Finished, StopStage, TextStage
from sluiceway.parsers.registry import TextPathOptions, build_stages
from sluiceway.protocol.messages import ChoiceDelta, FinishCause, TokenLogprob, TokenSample

from .harness import (
    PipelineRun,
    Recorder,
    Tokenized,
    Watermarks,
    examples,
    home_chunks,
    tokenize,
)
from .test_pipeline_contract import MIXED_CASE, cases


class RecordingPipeline(ChoicePipeline):
    """A pipeline that keeps the chunks it hands out, with the step of each,
    and each step's watermark (worked out by the harness, as the step ends)."""

    def __init__(
        self, tokenized: Tokenized, stages: Sequence[TextStage], stop: StopStage | None
    ) -> None:
        self.recorder = Recorder()
        super().__init__(tokenized.table, [*stages, self.recorder], stop=stop)
        self.watermarks = Watermarks(tokenized.table, stages)
        self.chunks: list[tuple[int, Chunk]] = []
        self.final: Chunk | None = None

    def feed(self, token_id: int, *, visible: bool = True) -> list[Chunk]:
        chunks = super().feed(token_id, visible=visible)
        step = self.tokens_fed - 1
        self.chunks.extend((step, chunk) for chunk in chunks)
        self.watermarks.after(step, token_id, visible=visible)
        return chunks

    def finish(self) -> Finished:
        done = super().finish()
        self.chunks.extend((self.tokens_fed, chunk) for chunk in done.chunks)
        self.final = done.final
        return done


@dataclass
class IdsRun:
    run: PipelineRun
    deltas: list[ChoiceDelta]
    ids: tuple[int, ...]


def run_with_ids(tokenized: Tokenized, options: TextPathOptions) -> IdsRun:
    stages, stop = build_stages(options)
    pipeline = RecordingPipeline(tokenized, stages, stop)
    choice = ChoiceOutput(
        index=0,
        pipeline=pipeline,
        entries=EntryFactory(tokenized.table),
        with_logprobs=True,
        include_stop_token_text=False,
        with_ids=True,
    )
    deltas: list[ChoiceDelta] = []
    for token_id in tokenized.ids:
        eos = token_id in tokenized.table.hidden
        sample = TokenSample(
            choice=0,
            token_id=token_id,
            logprob=TokenLogprob(logprob=-1.0),
            finish=FinishCause.EOS if eos else None,
        )
        produced, stopped = choice.take(sample)
        deltas += produced
        if stopped or eos:
            break
    deltas += choice.abandon()
    assert pipeline.final is not None
    run = PipelineRun(
        chunks=pipeline.chunks,
        final=pipeline.final,
        events=pipeline.recorder.steps,
        watermarks=pipeline.watermarks.values,
        tokens_fed=pipeline.tokens_fed,
        counts=pipeline.channel_counts(),
        stopped_by=pipeline.stopped_by,
    )
    return IdsRun(run, deltas, tokenized.ids[: pipeline.tokens_fed])


def _resolved_at(run: PipelineRun, token: int) -> int:
    """The step after which none of ``token``'s text can come (the finish: tokens_fed)."""
    steps = range(token, len(run.watermarks))
    return next((s for s in steps if run.watermarks[s] > token), run.tokens_fed)


def assert_ownership(result: IdsRun) -> None:
    run, deltas = result.run, result.deltas
    chunks = run.all_chunks()
    assert len(deltas) == len(chunks), "one delta per chunk, then the final one"
    # Every generated id once, in order.
    assert tuple(i for d in deltas for i in d.token_ids) == result.ids
    sent_in: list[int] = []
    for index, delta in enumerate(deltas):
        sent_in += [index] * len(delta.token_ids)
    homes, _ = home_chunks(run)
    for token, chunk_index in enumerate(sent_in):
        step, chunk = chunks[chunk_index]
        # Never before the token exists.
        assert step >= token, f"id {token} sent at step {step}"
        # No later than the chunk with its first character: no chunk carries
        # text whose owner's id is still to come.
        if token in homes:
            assert chunk_index <= homes[token][1], f"id {token} after its first character"
        else:
            # A markup id: no later than the first chunk after the step that
            # resolved it (or the final one).
            resolved = _resolved_at(run, token)
            bound = next((i for i, (s, _) in enumerate(chunks) if s > resolved), len(chunks) - 1)
            assert chunk_index <= bound, f"markup id {token}: chunk {chunk_index} > {bound}"
        # And no earlier than needed: the chunk carries the entry of this
        # token or of a later one (or it is the final one).
        if chunk_index < len(chunks) - 1:
            carried = (*chunk.reasoning_tokens, *chunk.content_tokens, *chunk.tool_call_tokens)
            assert max(carried, default=-1) >= token, f"id {token} sent early"


@settings(max_examples=examples(300), deadline=None)
@given(case=cases())
@example(case=MIXED_CASE)
def test_token_ids_follow_the_ownership_rule(case: tuple[TextPathOptions, str, Tokenized]) -> None:
    options, _, tokenized = case
    assert_ownership(run_with_ids(tokenized, options))


def test_ids_ride_with_their_first_character_and_markup_with_the_next() -> None:
    text = "<think>hm</think>\n\nHi"
    cuts = [
        len(b"<think>"),
        len(b"<think>hm"),
        len(b"<think>hm</think>"),
        len(b"<think>hm</think>\n\n"),
    ]
    tokenized = tokenize(text.encode(), cuts, eos=True)
    result = run_with_ids(tokenized, TextPathOptions(reasoning_parser="qwen3"))
    assert_ownership(result)
    carried = [(d.reasoning, d.content, d.token_ids) for d in result.deltas]
    # <think> is markup before "hm": it rides with hm; </think> and the blank
    # line are markup before "Hi"; EOS rides with the finishing delta.
    assert carried == [("hm", "", (0, 1)), ("", "Hi", (2, 3, 4)), ("", "", (5,))]


def test_markup_ids_ride_with_the_chunk_of_their_channel_in_that_step() -> None:
    """Stop strings "abcd" and "bc" on "ab" | "c" | "x": "bc" completes in
    token 1 and ends the output there (token 2 never enters). That step
    releases "a" (token 0) and drops "bc": token 1 is markup of the content
    channel, resolved by that step, so its id rides with that step's content
    chunk, not with the finishing one."""
    tokenized = tokenize(b"abcx", [2, 3])
    result = run_with_ids(tokenized, TextPathOptions(stop=("abcd", "bc")))
    assert_ownership(result)
    carried = [(d.content, d.token_ids, d.finish) for d in result.deltas]
    assert carried == [("a", (0, 1), None), ("", (), FinishCause.STOP_STRING)]
