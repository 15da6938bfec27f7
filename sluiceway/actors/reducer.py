"""The logprob reducer actor: keeps only the logprobs rows asked for.

A step with no row asking passes straight through at the cost of one channel
hop; otherwise the reduction runs in a worker thread (on the event loop when
the logits are few, as the sampler does) and the logits are released with the
message it sends on.
"""

from __future__ import annotations

from dataclasses import replace

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from sluiceway.actors.logprobs import reduce_rows
from sluiceway.actors.sampler import INLINE_LOGITS
from sluiceway.protocol.messages import SampledStep


def reduce_step(step: SampledStep) -> SampledStep:
    source = step.processed if step.processed is not None else step.logits
    assert source is not None, "only steps that carry logits are reduced"
    logprobs = reduce_rows(source, step.token_ids, [row.logprobs for row in step.rows])
    return replace(step, logprobs=tuple(logprobs), logits=None, processed=None)


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
