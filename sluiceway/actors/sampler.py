"""The sampler actor: a step's logits in, sampled token ids out.

When a row asked for logprobs and a reducer is wired after us, the logits
(and, in ``processed`` mode, the distribution actually sampled from) travel on
with the ids; otherwise they are dropped here.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from sluiceway.actors.sampling import Sampler
from sluiceway.protocol.messages import LogitsStep, SampledStep


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerConfig:
    #: Forward logits for rows that asked for logprobs (a reducer is wired).
    forward_logits: bool = True
    #: Forward the processed distribution instead of the raw one.
    processed_logprobs: bool = False


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
    )


def _is_cheap(step: LogitsStep) -> bool:
    """A plain greedy step is one argmax: cheaper than two thread hops."""
    return all(row.plain for row in step.rows)


async def run(
    receive: ObjectReceiveStream[LogitsStep],
    send: ObjectSendStream[SampledStep],
    config: SamplerConfig,
) -> None:
    sampler = Sampler()
    async with receive, send:
        async for step in receive:
            if _is_cheap(step):
                sampled = sample_step(sampler, step, config)
            else:
                sampled = await anyio.to_thread.run_sync(sample_step, sampler, step, config)
            await send.send(sampled)
