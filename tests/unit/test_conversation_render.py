"""The neutral conversation renderer with a real tokenizer and templates:
system messages mid-conversation (at their place where the template renders
them, folded into the leading one where it refuses or drops them), the
thinking switch and its precedence, effort levels, earlier reasoning left
out, text no tokenizer takes."""

from __future__ import annotations

import pytest

from sluiceway.engines.base import EngineInfo
from sluiceway.engines.tokenizer import ChatTemplate, ModelTokenizer
from sluiceway.parsers.registry import ParserChoice
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces.base import Serving
from sluiceway.surfaces.conversation import (
    Conversation,
    Message,
    Role,
    StopOptions,
    render_conversation,
)
from sluiceway.surfaces.reasoning import (
    Effort,
    keep_recent_reasoning,
    reasoning_level,
    thinking_for_effort,
)
from tests.fixtures.scripted_model import ScriptedModel

#: Like many real templates (Qwen3's among them): a system message anywhere
#: but first is an error.
REFUSES = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and not loop.first -%}"
    "{{ raise_exception('System message must be at the beginning.') }}"
    "{%- endif -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
#: Renders the first message's system text and silently drops later ones.
DROPS = (
    "{%- for m in messages -%}"
    "{%- if m.role != 'system' or loop.first -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

CONVERSATION = (
    Message(role=Role.SYSTEM, text="Be kind."),
    Message(role=Role.USER, text="hello"),
    Message(role=Role.SYSTEM, text="Now be brief."),
)


def serving(scripted: ScriptedModel, template: str | None = None, **defaults: object) -> Serving:
    tokenizer = ModelTokenizer(scripted.path, 512)
    if template is not None:
        tokenizer.chat = ChatTemplate(tokenizer.hf, template=template)
    return Serving(
        model_name="m",
        created=0,
        engine=EngineInfo(
            name="test", device="cpu", dtype="float32", vocab_size=512, max_context=8192
        ),
        tokenizer=tokenizer,
        parsers=ParserChoice("qwen3", "hermes"),
        max_num_seqs=1,
        max_top_logprobs=0,
        stop_in_reasoning=False,
        default_template_kwargs=defaults,
    )


def prompt(serving: Serving, conversation: Conversation) -> str:
    ids = render_conversation(serving, conversation, StopOptions()).ids
    return serving.tokenizer.hf.decode(list(ids))


def test_a_system_message_renders_at_its_place_where_the_template_allows(
    scripted: ScriptedModel,
) -> None:
    text = prompt(serving(scripted), Conversation(messages=CONVERSATION))
    assert text.index("Be kind.") < text.index("hello") < text.index("Now be brief.")


@pytest.mark.parametrize("template", [REFUSES, DROPS], ids=["refuses", "drops"])
def test_otherwise_it_is_folded_into_the_leading_one(
    scripted: ScriptedModel, template: str
) -> None:
    text = prompt(serving(scripted, template), Conversation(messages=CONVERSATION))
    assert text.startswith("<|im_start|>system\nBe kind.\n\nNow be brief.<|im_end|>")
    assert text.count("<|im_start|>system") == 1
    assert "hello" in text


def test_a_template_error_without_late_system_messages_is_the_requests(
    scripted: ScriptedModel,
) -> None:
    broken = serving(scripted, "{{ raise_exception('no') }}")
    with pytest.raises(InvalidRequest, match="could not render"):
        prompt(broken, Conversation(messages=CONVERSATION[1:2]))


def test_the_thinking_switch_and_its_precedence(scripted: ScriptedModel) -> None:
    closed = "<think>\n\n</think>"  # the project's template closes thinking when it is off
    user = (Message(role=Role.USER, text="hi"),)
    off_by_default = serving(scripted, None, enable_thinking=False)
    assert closed in prompt(off_by_default, Conversation(messages=user))
    assert closed not in prompt(off_by_default, Conversation(messages=user, thinking=True))
    # A request's own template variables have the last word.
    both = Conversation(messages=user, thinking=True, template_kwargs={"enable_thinking": False})
    assert closed in prompt(off_by_default, both)
    assert closed in prompt(serving(scripted), Conversation(messages=user, thinking=False))


def test_text_no_tokenizer_takes_is_replaced(scripted: ScriptedModel) -> None:
    lone = (Message(role=Role.USER, text="half a pair: \ud83d!"),)
    assert "half a pair: \ufffd!" in prompt(serving(scripted), Conversation(messages=lone))


def test_effort_levels_onto_the_switch() -> None:
    assert [thinking_for_effort(effort) for effort in Effort] == [
        False,
        False,
        False,
        True,
        True,
        True,
        True,
    ]


def test_effort_levels_onto_the_templates_reasoning_level(scripted: ScriptedModel) -> None:
    assert [reasoning_level(effort.value) for effort in Effort] == [
        "low", "low", "low", "medium", "high", "high", "high",
    ]  # fmt: skip
    assert (reasoning_level(None), reasoning_level("lots")) == (None, None)
    level = "{{ reasoning_effort | default('unset') }}"
    user = (Message(role=Role.USER, text="hi"),)
    assert prompt(serving(scripted, level), Conversation(messages=user)) == "unset"
    assert prompt(serving(scripted, level), Conversation(messages=user, effort="low")) == "low"
    # A request's own template variables have the last word.
    mine = Conversation(messages=user, effort="low", template_kwargs={"reasoning_effort": "x"})
    assert prompt(serving(scripted, level), mine) == "x"


def test_keep_recent_reasoning() -> None:
    history = (
        Message(role=Role.USER, text="q"),
        Message(role=Role.ASSISTANT, text="a", reasoning="r1"),
        Message(role=Role.USER, text="q"),
        Message(role=Role.ASSISTANT, text="b", reasoning="r2"),
        Message(role=Role.ASSISTANT, text="c", reasoning="r3"),
    )
    assert [m.reasoning for m in keep_recent_reasoning(history, 2)] == ["", "", "", "r2", "r3"]
    assert keep_recent_reasoning(history, 5) == history
    assert all(not m.reasoning for m in keep_recent_reasoning(history, 0))
