"""What crosses the engine process's pipe (sluiceway.actors.engine_pipe)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sluiceway.actors.engine_pipe import (
    DECODE,
    PICKED,
    PICKLED,
    GreedyDecode,
    dump_call,
    dump_reply,
    load_call,
    load_reply,
)
from sluiceway.actors.engine_work import StepPlan
from sluiceway.actors.sampling import Draw
from sluiceway.protocol.messages import TokenLogprob

ids = st.integers(min_value=0, max_value=2**40)
decodes = st.dictionaries(ids, ids, max_size=70)


@given(
    decode=decodes,
    greedy=st.booleans(),
    frees=st.lists(ids, max_size=3).map(tuple),
    ending=st.lists(ids, max_size=3).map(tuple),
    stop_ids=st.frozensets(ids, max_size=3),
)
def test_every_plan_crosses_the_pipe_unchanged(
    decode: dict[int, int],
    greedy: bool,
    frees: tuple[int, ...],
    ending: tuple[int, ...],
    stop_ids: frozenset[int],
) -> None:
    plan = StepPlan(frees=frees, decode=decode, greedy=greedy, ending=ending, stop_ids=stop_ids)
    data = dump_call("execute", (plan,), {})
    # Only a plan that decodes greedily and does nothing else is packed
    # (its stop ids with it: the steady step carries the model's EOS).
    packed = greedy and bool(decode) and not frees and not ending
    assert data[:1] == (DECODE if packed else PICKLED)
    method, args, kwargs = load_call(data)
    assert (method, kwargs) == ("execute", {})
    (received,) = args
    assert received == plan
    assert list(received.decode.items()) == list(plan.decode.items())  # the rows' order too


def test_a_plan_with_draws_or_masks_is_pickled_whole() -> None:
    draw = Draw(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, uniform=0.25)
    plan = StepPlan(decode={1: 5}, greedy=True, draws={1: draw})
    data = dump_call("execute", (plan,), {})
    assert data[:1] == PICKLED
    assert load_call(data)[1] == (plan,)
    masked = StepPlan(decode={1: 5}, greedy=True, masks={1: np.ones(2, dtype=np.int32)})
    assert dump_call("execute", (masked,), {})[:1] == PICKLED


def test_other_calls_and_their_replies_are_pickled() -> None:
    data = dump_call("prefill", (3, (1, 2, 3)), {"all_logits": True})
    assert data[:1] == PICKLED
    assert load_call(data) == ("prefill", (3, (1, 2, 3)), {"all_logits": True})
    for reply in [("ok", None), ("error", "decode failed: out of memory"), ("ok", {"a": 1})]:
        assert load_reply(dump_reply(*reply)) == reply


@given(rows=st.lists(st.tuples(ids, ids), max_size=70, unique_by=lambda row: row[0]))
def test_a_decode_reply_crosses_as_integers(rows: list[tuple[int, int]]) -> None:
    slots = tuple(slot for slot, _ in rows)
    tokens = np.array([token for _, token in rows], dtype=np.int64).tobytes()
    data = dump_reply("ok", GreedyDecode(slots, tokens))
    assert data[:1] == PICKED
    assert len(data) == 1 + 16 * len(rows)
    status, value = load_reply(data)
    assert status == "ok"
    assert value == GreedyDecode(slots, tokens)
    outcome = value.outcome()
    assert outcome.decode.slots == slots
    assert outcome.decode_greedy.tolist() == [token for _, token in rows]


def test_a_decode_reply_with_logprobs_is_pickled() -> None:
    scored = [TokenLogprob(-0.25, ((4, -0.25), (1, -2.5)), ((9, -7.0),)), None]
    reply = GreedyDecode((7, 2), np.array([4, 8], dtype=np.int64).tobytes(), scored)
    data = dump_reply("ok", reply)
    assert data[:1] == PICKLED
    assert load_reply(data) == ("ok", reply)


def test_the_packed_plan_knows_every_field_of_a_plan() -> None:
    """A plan field added later must be checked by ``_packed_plan`` (or be
    packed), else a packed plan would silently drop it."""
    from dataclasses import fields

    known = {"cache_ops", "frees", "prefills", "decode", "greedy", "masks", "draws"}
    known |= {"ending", "stop_ids"}
    assert {field.name for field in fields(StepPlan)} == known
