"""The exact-turns splice on the default model's template (Qwen-style: it
drops the reasoning of past assistant turns): the close after the generated
ids, the suffix, and every refusal naming its message and field."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.surfaces.conversation import template_renderer
from sluiceway.surfaces.exact_turns import (
    ExactPrompt,
    Render,
    TurnIdsError,
    prefix_preserving,
    splice,
)
from sluiceway.surfaces.turns import Message, Role, ToolCall, TurnIds

VOCAB = 1920


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> ModelTokenizer:
    return ModelTokenizer(default_model, VOCAB)


@pytest.fixture(scope="module")
def render(tokenizer: ModelTokenizer) -> Render:
    return template_renderer(tokenizer, {})


USER = Message(role=Role.USER, text="What is the weather?")
CALL = ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
RESULT = Message(role=Role.TOOL, text='{"temp": 21}', tool_call_id="c1")


def ids_of(tokenizer: ModelTokenizer, render: Render, messages: Sequence[Message]) -> list[int]:
    return tokenizer.encode(render(messages, True, False))


def run(
    tokenizer: ModelTokenizer, render: Render, messages: Sequence[Message]
) -> ExactPrompt | None:
    return splice(messages, render=render, encode=tokenizer.encode, vocab_size=VOCAB)


def answered(tokenizer: ModelTokenizer, render: Render, text: str, *, eos: bool) -> Message:
    """An assistant reply carrying the ids a server would have returned for
    ``text`` (the end-of-turn token last when the model ended by itself)."""
    generation = tokenizer.encode(text + ("<|im_end|>" if eos else ""))
    return Message(
        role=Role.ASSISTANT,
        text=text,
        ids=TurnIds(prompt=tuple(ids_of(tokenizer, render, [USER])), generation=tuple(generation)),
    )


@pytest.mark.parametrize("eos", [True, False])
def test_where_the_template_keeps_history_the_splice_equals_a_full_render(
    tokenizer: ModelTokenizer, render: Render, eos: bool
) -> None:
    """No reasoning to drop: re-rendering is exact, so the splice must give
    the very same ids, whether the reply ended on <|im_end|> (only the
    newline after it is added) or was cut short (the whole close is)."""
    reply = answered(tokenizer, render, "Sunny, 21 degrees.", eos=eos)
    follow = Message(role=Role.USER, text="And tomorrow?")
    exact = run(tokenizer, render, [USER, reply, follow])
    assert exact is not None
    plain = ids_of(tokenizer, render, [USER, Message(role=Role.ASSISTANT, text=reply.text), follow])
    assert list(exact.ids) == plain
    assert reply.ids is not None
    assert reply.ids.prompt is not None
    assert reply.ids.generation is not None
    assert exact.reused == len(reply.ids.prompt) + len(reply.ids.generation)


def test_past_reasoning_stays_in_the_spliced_prompt(
    tokenizer: ModelTokenizer, render: Render
) -> None:
    text = "<think>\nNeed weather.\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    prompt = tuple(ids_of(tokenizer, render, [USER]))
    generation = tuple(tokenizer.encode(text + "<|im_end|>"))
    reply = Message(
        role=Role.ASSISTANT,
        reasoning="Need weather.",
        tool_calls=(CALL,),
        ids=TurnIds(prompt=prompt, generation=generation),
    )
    exact = run(tokenizer, render, [USER, reply, RESULT])
    assert exact is not None
    assert exact.ids[: len(prompt) + len(generation)] == prompt + generation
    suffix = tokenizer.hf.decode(exact.ids[len(prompt) + len(generation) :])
    rerendered = render([USER, reply, RESULT], True, False)
    assert suffix.startswith("\n<|im_start|>user")  # the newline the close adds after EOS
    assert rerendered.endswith(suffix)  # then the tool result, as the template writes it
    assert "Need weather" not in rerendered  # what the ids protect against


def test_messages_without_ids_render_as_before(tokenizer: ModelTokenizer, render: Render) -> None:
    assert run(tokenizer, render, [USER, Message(role=Role.ASSISTANT, text="hi"), USER]) is None


def test_the_latest_assistant_with_ids_is_spliced(
    tokenizer: ModelTokenizer, render: Render
) -> None:
    first = answered(tokenizer, render, "One.", eos=True)
    second = Message(
        role=Role.ASSISTANT,
        text="Two.",
        ids=TurnIds(prompt=(1, 2, 3), generation=(4,)),
    )
    with pytest.raises(TurnIdsError) as raised:  # (1, 2, 3) is not what USER renders to
        run(tokenizer, render, [USER, first, USER, second, USER])
    assert (raised.value.index, raised.value.field) == (3, "prompt_token_ids")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (Message(role=Role.USER, text="x", ids=TurnIds(prompt=(1,), generation=(2,))), "prompt_token_ids"),
        (Message(role=Role.ASSISTANT, text="x", ids=TurnIds(prompt=(1,))), "generation_token_ids"),
        (Message(role=Role.ASSISTANT, text="x", ids=TurnIds(generation=(1,))), "prompt_token_ids"),
        (Message(role=Role.ASSISTANT, text="x", ids=TurnIds(prompt=(1,), generation=(VOCAB,))), "generation_token_ids"),
        (Message(role=Role.ASSISTANT, text="x", ids=TurnIds(prompt=(-1,), generation=(1,))), "prompt_token_ids"),
        (Message(role=Role.ASSISTANT, text="x", ids=TurnIds(prompt=(), generation=(1,))), "prompt_token_ids"),
    ],
)  # fmt: skip
def test_bad_ids_name_the_message_and_field(
    tokenizer: ModelTokenizer, render: Render, message: Message, field: str
) -> None:
    with pytest.raises(TurnIdsError) as raised:
        run(tokenizer, render, [USER, message, USER])
    assert (raised.value.index, raised.value.field) == (1, field)


def test_a_template_that_rewrites_history_for_new_messages_is_refused(
    tokenizer: ModelTokenizer,
) -> None:
    """A template whose rendering of the history depends on what follows
    (here: a message count at the top) is not prefix-preserving: 400 at the
    first new message, never a silent splice."""

    def counting(messages: Sequence[Message], generation: bool, continued: bool) -> str:
        turns = [f"<|im_start|>{m.role.value}\n{m.text}<|im_end|>\n" for m in messages]
        head = f"<|im_start|>system\n{len(messages)} turns<|im_end|>\n"
        return head + "".join(turns) + ("<|im_start|>assistant\n" if generation else "")

    prompt = tuple(tokenizer.encode(counting([USER], True, False)))
    reply = Message(role=Role.ASSISTANT, text="a", ids=TurnIds(prompt=prompt, generation=(5,)))
    with pytest.raises(TurnIdsError) as raised:
        splice([USER, reply, USER], render=counting, encode=tokenizer.encode, vocab_size=VOCAB)
    assert (raised.value.index, raised.value.field) == (2, None)


def test_the_probe_finds_the_template_drops_past_reasoning(render: Render) -> None:
    assert prefix_preserving(render) == {"user": False, "tool": False}

    def keeping(messages: Sequence[Message], generation: bool, continued: bool) -> str:
        body = "".join(f"<{m.role.value}>{m.reasoning}{m.text}</>" for m in messages)
        return body + ("<assistant>" if generation else "")

    assert prefix_preserving(keeping) == {"user": True, "tool": True}
