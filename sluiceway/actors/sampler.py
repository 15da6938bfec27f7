"""The sampler actor: a step's logits in, sampled token ids out.

When a row asked for logprobs and a reducer is wired after us, the logits
(and, in ``processed`` mode, the distribution actually sampled from) travel on
with the ids; otherwise they are dropped here.

Constrained rows need a grammar mask per token. Once a step is sampled, the
next masks are computed in a worker thread while the step travels back to the
scheduler and the engine runs the next forward pass; the next step waits for
them only if they are not ready by then.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from sluiceway.actors.sampling import Sampler
from sluiceway.engines.grammar import GrammarEngine
from sluiceway.protocol.messages import LogitsStep, SampledStep


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
        step.logits, step.rows, keep_processed=wants and config.processed_logprobs
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
    would compute that one here, so such a step goes to a thread."""
    if all(row.plain for row in step.rows):
        return True
    return step.logits.size <= INLINE_LOGITS and not any(
        row.first and row.constraint is not None for row in step.rows
    )


async def run(
    receive: ObjectReceiveStream[LogitsStep],
    send: ObjectSendStream[SampledStep],
    config: SamplerConfig,
) -> None:
    sampler = Sampler(config.grammars)
    async with receive, send, anyio.create_task_group() as group:
        masks: anyio.Event | None = None
        async for step in receive:
            if masks is not None:
                await masks.wait()  # the sampler's state is not shared with that thread
                masks = None
            if _is_cheap(step):
                sampled = sample_step(sampler, step, config)
            else:
                sampled = await anyio.to_thread.run_sync(sample_step, sampler, step, config)
            if sampler.masks_due():
                masks = anyio.Event()
                group.start_soon(_prepare_masks, sampler, masks)
            await send.send(sampled)


async def _prepare_masks(sampler: Sampler, done: anyio.Event) -> None:
    try:
        await anyio.to_thread.run_sync(sampler.prepare_masks)
    finally:
        done.set()
