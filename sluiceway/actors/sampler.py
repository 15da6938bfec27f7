"""The sampler actor: a step's logits in, sampled token ids out.

When a row asked for logprobs and a reducer is wired after us, the logits
(and, in ``processed`` mode, the distribution actually sampled from) travel on
with the ids; otherwise they are dropped here.

Constrained rows need a grammar mask per token. Once a step is sampled here,
the next masks are computed in a worker thread while the step travels back to
the scheduler and the engine runs the next forward pass; the next step waits
for them only if they are not ready by then.

A small step never reaches this actor: the scheduler samples (and reduces) it
itself through :meth:`StepSampler.inline`, on the same sampler state, because
a round through the sampler and reducer tasks costs more event-loop time than
the sampling (``bench/pertoken-results.md``). In a greedy step the engine
picks the tokens, a greedy constrained row's under the mask the scheduler
got from :meth:`StepSampler.allowed`, and :meth:`StepSampler.take` advances
the matchers by them. The state is shared safely because the scheduler waits
for each step it sends here, ``inline`` declines while a mask computation is
under way in a thread, and ``allowed`` and ``take`` wait for it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup

from sluiceway.actors.logprobs import reduce_step
from sluiceway.actors.sampling import Draw, Sampler
from sluiceway.engines.grammar import Bitmask, GrammarEngine
from sluiceway.protocol.messages import ConstraintReport, LogitsStep, Row, SampledStep


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerConfig:
    #: Forward logits for rows that asked for logprobs (a reducer is wired).
    forward_logits: bool = True
    #: Forward the processed distribution instead of the raw one.
    processed_logprobs: bool = False
    #: Masks constrained rows; without one, a constrained request fails.
    grammars: GrammarEngine | None = None


def sample_step(sampler: Sampler, step: LogitsStep, config: SamplerConfig) -> SampledStep:
    wants = config.forward_logits and any(row.logprobs.per_token for row in step.rows)
    result = sampler.sample(
        step.logits, step.rows, keep_processed=wants and config.processed_logprobs, live=step.live
    )
    return SampledStep(
        step=step.step,
        rows=step.rows,
        token_ids=tuple(result.token_ids.tolist()),
        logits=step.logits if wants and not config.processed_logprobs else None,
        processed=result.processed if wants else None,
        constraints=result.constraints,
    )


#: A step with at most this many logits is sampled on the event loop: on so
#: few numbers NumPy's calls are too short to release the GIL for long, so a
#: worker thread buys no parallelism and costs two thread hops and their task
#: switches (``bench/pertoken-results.md``). 1 << 16 is 34 rows of the tiny
#: default model, or half a row of a 150k vocabulary: a large vocabulary's
#: rows, where the sort and cumulative sums take milliseconds, stay in a
#: worker thread.
INLINE_LOGITS = 1 << 16


def _is_cheap(step: LogitsStep) -> bool:
    """A plain greedy step is one argmax, and a small step a few short NumPy
    calls: cheaper than two thread hops. A constrained row's mask was
    computed ahead, off the loop, except for its first token: llguidance
    would compute that one here (and may wait for its grammar's compile),
    so such a step goes to a thread."""
    if all(row.plain for row in step.rows):
        return True
    return step.logits.size <= INLINE_LOGITS and not any(
        row.first and row.constraint is not None for row in step.rows
    )


class StepSampler:
    """The sampler's state and its ways to a step: inline on the caller's
    task for a cheap step, or the actor (:func:`run`) for the rest; and, for
    greedy steps whose tokens the engine picks, the guided rows' masks
    (:meth:`allowed`) and their advance (:meth:`take`)."""

    def __init__(self, config: SamplerConfig, *, reduce: bool) -> None:
        self.config = config
        self.sampler = Sampler(config.grammars)
        #: A reducer is wired after the sampler, so logprobs are asked for.
        self._reduce = reduce
        #: A worker thread is computing masks from the sampler's state...
        self.preparing_masks = False
        #: ... and sets this when done.
        self._masks: anyio.Event | None = None

    def inline(self, step: LogitsStep) -> SampledStep | None:
        """Sample (and reduce) a cheap step of at most :data:`INLINE_LOGITS`
        logits here and now (a constrained row's masks computed here too, ~35
        µs a row on a small vocabulary); None when the step must go to the
        actors instead."""
        if self.preparing_masks or step.logits.size > INLINE_LOGITS or not _is_cheap(step):
            return None
        sampled = sample_step(self.sampler, step, self.config)
        if self._reduce and (sampled.logits is not None or sampled.processed is not None):
            return reduce_step(sampled)
        return sampled

    async def allowed(self, rows: Sequence[Row]) -> list[Bitmask] | None:
        """The masks of guided greedy ``rows`` for their next token, for the
        engine to apply before its argmax; None when one has none (the step
        then goes through the sampler, which reports why). Computed here on
        a small vocabulary, in a worker thread on a large one (the engine is
        decoding ahead meanwhile)."""
        await self.settle()
        sampler = self.sampler
        if sampler.masks_due():
            if self._mask_work(len(rows)) <= INLINE_LOGITS:
                sampler.prepare_masks()
            else:
                await _prepare_masks(self, self._start())
        return sampler.allowed(rows)

    async def take(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[int],
        live: Collection[tuple[str, int]] = (),
    ) -> ConstraintReport | None:
        """Advance the guides of a greedy step's rows by the engine's tokens
        (``live``: the keys of the other running choices)."""
        await self.settle()
        return self.sampler.take(rows, token_ids, live)

    async def draws(self, live: Collection[tuple[str, int]], drawn: Sequence[Row]) -> list[Draw]:
        """How the engine is to pick each of ``drawn`` (unadjusted rows of a
        step whose tokens it picks; ``live``: the keys of all the step
        decodes): each sampled row's draw for this step, and the logprobs to
        reduce where this sampler would have had them reduced."""
        await self.settle()
        uniforms = self.sampler.uniforms(live, drawn)
        scored = self._reduce and self.config.forward_logits
        processed = self.config.processed_logprobs
        return [
            Draw.of(
                row.sampling,
                uniform,
                row.logprobs if scored and row.logprobs.per_token else None,
                processed,
            )
            for row, uniform in zip(drawn, uniforms, strict=True)
        ]

    async def settle(self) -> None:
        """Wait for masks being computed in a worker thread, if they are."""
        if self._masks is not None:
            await self._masks.wait()

    def start_masks(self, group: TaskGroup) -> None:
        """Compute due masks in a worker thread, in the background."""
        if self.sampler.masks_due():
            group.start_soon(_prepare_masks, self, self._start())

    def _start(self) -> anyio.Event:
        self.preparing_masks = True
        self._masks = anyio.Event()
        return self._masks

    def _mask_work(self, rows: int) -> int:
        grammars = self.config.grammars
        return rows * (grammars.vocab_size if grammars is not None else 0)


async def run(
    receive: ObjectReceiveStream[LogitsStep],
    send: ObjectSendStream[SampledStep],
    core: StepSampler,
) -> None:
    sampler, config = core.sampler, core.config
    async with receive, send, anyio.create_task_group() as group:
        async for step in receive:
            await core.settle()  # the sampler's state is not shared with that thread
            if _is_cheap(step):
                sampled = sample_step(sampler, step, config)
            else:
                sampled = await anyio.to_thread.run_sync(sample_step, sampler, step, config)
            core.start_masks(group)
            await send.send(sampled)


async def _prepare_masks(core: StepSampler, done: anyio.Event) -> None:
    try:
        await anyio.to_thread.run_sync(core.sampler.prepare_masks)
    finally:
        core.preparing_masks = False
        core._masks = None
        done.set()
