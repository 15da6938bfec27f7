"""The logprob reducer actor: keeps only the logprobs rows asked for.

A step with no row asking passes straight through at the cost of one channel
hop; otherwise the reduction runs in a worker thread (on the event loop when
the logits are few, as the sampler does) and the logits are released with the
message it sends on. Most small steps never come here: the scheduler samples
and reduces them itself (``sluiceway.actors.sampler.StepSampler``).
"""

from __future__ import annotations

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from sluiceway.actors.logprobs import reduce_step
from sluiceway.actors.sampler import INLINE_LOGITS
from sluiceway.protocol.messages import SampledStep


async def run(
    receive: ObjectReceiveStream[SampledStep],
    send: ObjectSendStream[SampledStep],
) -> None:
    async with receive, send:
        async for step in receive:
            source = step.processed if step.processed is not None else step.logits
            if source is None:
                await send.send(step)
            elif source.size <= INLINE_LOGITS:
                await send.send(reduce_step(step))
            else:
                await send.send(await anyio.to_thread.run_sync(reduce_step, step))
