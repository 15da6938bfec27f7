"""What crosses the engine process's pipe: the steady decode as packed
integers, everything else pickled.

Almost every message on the pipe is the same pair: a plan that only decodes
(each row's slot and token, greedy) and a reply with the engine's pick for
each row. At concurrency 1, pickling a one-row reply took the child ~32 µs
(the pickle machinery runs cold after a forward pass has been through the
caches), on the path between one forward pass and the next, and the event
loop paid for its side too. Packed as 64-bit integers behind a one-byte tag
the reply costs ~6 µs; any other message, and any plan or reply with more in
it, is pickled behind its own tag, as before.
"""

from __future__ import annotations

import pickle
from array import array
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from sluiceway.actors.engine_work import StepOutcome, StepPlan
from sluiceway.engines.base import DecodeResult
from sluiceway.protocol.messages import TokenLogprob

#: The tags: the first byte of every message.
PICKLED = b"P"
#: A plan that decodes greedily and does nothing else: the count of its
#: stop ids, the ids, then (slot, token) pairs.
DECODE = b"D"
#: A decode step's reply without logprobs: the slots, then the engine's picks.
PICKED = b"G"

#: Bytes per packed integer.
WORD = 8


def dump_call(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """A call from the parent to the child."""
    if method == "execute" and not kwargs and len(args) == 1:
        packed = _packed_plan(args[0])
        if packed is not None:
            return packed
    return _pickled((method, args, kwargs))


def load_call(data: bytes) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The call :func:`dump_call` packed."""
    if data[:1] == DECODE:
        values = memoryview(data)[1:].cast("q").tolist()
        stops = values[0] + 1
        pairs = values[stops:]
        plan = StepPlan(
            decode=dict(zip(pairs[::2], pairs[1::2], strict=True)),
            greedy=True,
            stop_ids=frozenset(values[1:stops]),
        )
        return "execute", (plan,), {}
    call: tuple[str, tuple[Any, ...], dict[str, Any]] = pickle.loads(memoryview(data)[1:])
    return call


def dump_reply(status: str, value: Any) -> bytes:
    """A reply from the child: ``("ok", value)`` or ``("error", message)``."""
    if status == "ok" and type(value) is GreedyDecode and value.logprobs is None:
        return PICKED + array("q", value.slots).tobytes() + value.tokens
    return _pickled((status, value))


def load_reply(data: bytes) -> tuple[str, Any]:
    """The reply :func:`dump_reply` packed."""
    if data[:1] == PICKED:
        rows = (len(data) - 1) // (2 * WORD)
        split = 1 + rows * WORD
        slots = tuple(memoryview(data)[1:split].cast("q").tolist())
        return "ok", GreedyDecode(slots, data[split:])
    reply: tuple[str, Any] = pickle.loads(memoryview(data)[1:])
    return reply


def _pickled(message: tuple[Any, ...]) -> bytes:
    # multiprocessing's pickler, as ``Connection.send`` used: it knows how
    # to send what the standard one does not (connections, sockets).
    return PICKLED + bytes(ForkingPickler.dumps(message))


def _packed_plan(plan: Any) -> bytes | None:
    """``plan`` packed, if it only decodes greedily (else None: pickle it)."""
    if type(plan) is not StepPlan or not plan.greedy or not plan.decode:
        return None
    if plan.cache_ops or plan.frees or plan.prefills or plan.masks or plan.draws or plan.ending:
        return None
    values = array("q", (len(plan.stop_ids), *plan.stop_ids))
    for slot, token in plan.decode.items():
        values.append(slot)
        values.append(token)
    return DECODE + values.tobytes()


@dataclass(frozen=True, slots=True)
class GreedyDecode:
    """A decode-only step whose tokens the engine picked, as it crosses the
    pipe: the slots and their tokens as plain values, and the drawn rows'
    logprobs (named tuples) where any asked. Unpickling a whole
    ``StepOutcome`` (numpy arrays, dataclasses) took ~84 µs of the event
    loop per step; pickling one with 16 rows of top-5 logprobs took the
    child ~70 µs warm, against ~40 µs for these values."""

    slots: tuple[int, ...]
    tokens: bytes  # int64, one per slot
    logprobs: list[TokenLogprob | None] | None = None

    def __reduce__(self) -> tuple[type[GreedyDecode], tuple[object, ...]]:
        return (GreedyDecode, (self.slots, self.tokens, self.logprobs))

    def outcome(self) -> StepOutcome:
        rows = len(self.slots)
        return StepOutcome(
            prefills=[],
            decode=DecodeResult(self.slots, np.empty((rows, 0), dtype=np.float32)),
            decode_greedy=np.frombuffer(self.tokens, dtype=np.int64),
            decode_logprobs=self.logprobs,
        )


def for_pipe(plan: StepPlan, outcome: StepOutcome) -> StepOutcome | GreedyDecode:
    """``outcome`` minus what the parent will not read.

    In a step whose tokens the engine picked the scheduler uses only the
    picks (and the drawn rows' logprobs), so the logits stay here (a
    zero-width view keeps each block's row count); the usual step, a decode
    with nothing else (its drawn rows' logprobs included), goes as a
    ``GreedyDecode``.
    """
    if not plan.greedy:
        return outcome
    decoded, greedy = outcome.decode, outcome.decode_greedy
    plain = not outcome.prefills and not outcome.late and outcome.cache_error is None
    if plain and decoded is not None and greedy is not None:
        tokens = greedy.astype(np.int64, copy=False).tobytes()
        return GreedyDecode(decoded.slots, tokens, outcome.decode_logprobs)
    for prefilled in [*outcome.prefills, *outcome.late]:
        if prefilled.greedy is not None and prefilled.logits is not None:
            prefilled.logits = prefilled.logits[:, :0]
    if decoded is not None and greedy is not None:
        outcome = StepOutcome(
            prefills=outcome.prefills,
            decode=DecodeResult(decoded.slots, decoded.logits[:, :0]),
            decode_error=outcome.decode_error,
            decode_greedy=greedy,
            decode_logprobs=outcome.decode_logprobs,
            cache_error=outcome.cache_error,
            late=outcome.late,
        )
    return outcome
