"""The registries, option handling and parser detection."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from sluiceway.engines.tokenizer import ChatTemplate
from sluiceway.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    TextPathOptions,
    UnknownParserError,
    build_stages,
    detect_parsers,
    forced_tool_prefix,
)
from sluiceway.parsers.stop import StopMatcher

QWEN3_TEMPLATE = """{%- if tools %}<|im_start|>system
For each function call, return a json object within <tool_call></tool_call> XML tags<|im_end|>
{%- endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{%- endif %}
{%- endif %}"""

DEEPSEEK_TEMPLATE = """{% for message in messages %}{% if message.role == 'user' %}<\uff5cUser\uff5c>{{ message.content }}{% endif %}{% endfor %}
{% if add_generation_prompt %}<\uff5cAssistant\uff5c><think>
{% endif %}"""

CODER_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{% if tools %}<tool_call>
<function=example>
<parameter=x>
1
</parameter>
</function>
</tool_call>{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

THINK_VOCAB = {"<think>", "</think>", "<tool_call>", "</tool_call>", "a"}


def test_registries_are_read_only() -> None:
    assert set(REASONING_PARSERS) == {
        "qwen3",
        "deepseek_r1",
        "glm45",
        "kimi_k2",
        "minimax_m2",
        "deepseek_v3",
        "mistral",
    }
    assert set(TOOL_PARSERS) == {
        "hermes",
        "qwen3_coder",
        "glm45",
        "glm47",
        "kimi_k2",
        "minimax_m2",
        "deepseek_v31",
        "deepseek_v3",
        "llama3_json",
        "pythonic",
        "mistral",
    }
    with pytest.raises(TypeError):
        REASONING_PARSERS["x"] = REASONING_PARSERS["qwen3"]  # type: ignore[index]


def test_unknown_parsers_raise() -> None:
    with pytest.raises(
        UnknownParserError,
        match="known: deepseek_r1, deepseek_v3, glm45, kimi_k2, minimax_m2, mistral, qwen3",
    ):
        build_stages(TextPathOptions(reasoning_parser="nope"))
    with pytest.raises(UnknownParserError):
        build_stages(TextPathOptions(tool_parser="nope"))
    with pytest.raises(UnknownParserError):
        forced_tool_prefix("nope", None)


def test_stages_in_order() -> None:
    stages, stop = build_stages(
        TextPathOptions(reasoning_parser="qwen3", tool_parser="hermes", stop=("x",))
    )
    assert [type(s).__name__ for s in stages] == ["ReasoningParser", "StopMatcher", "FormatParser"]
    assert isinstance(stop, StopMatcher)
    assert build_stages(TextPathOptions()) == ((), None)


def test_forced_prefixes() -> None:
    assert forced_tool_prefix("hermes", None) == '<tool_call>\n{"name": "'
    assert forced_tool_prefix("hermes", "f") == '<tool_call>\n{"name": "f", "arguments": '
    assert forced_tool_prefix("qwen3_coder", None) == "<tool_call>\n<function="
    assert forced_tool_prefix("qwen3_coder", "f") == "<tool_call>\n<function=f>\n"


@pytest.mark.parametrize(
    ("template", "vocabulary", "expected"),
    [
        (QWEN3_TEMPLATE, THINK_VOCAB, ("qwen3", "hermes")),
        (DEEPSEEK_TEMPLATE, THINK_VOCAB, ("deepseek_r1", None)),
        (CODER_TEMPLATE, THINK_VOCAB, (None, "qwen3_coder")),
        (QWEN3_TEMPLATE, {"a"}, (None, None)),
        (None, THINK_VOCAB, (None, None)),
        ("{{ broken", THINK_VOCAB, (None, None)),
        ("<think>{% if x %}{{ raise_exception('no') }}{% endif %}", THINK_VOCAB, ("qwen3", None)),
    ],
)
def test_detect_parsers(
    template: str | None, vocabulary: set[str], expected: tuple[str | None, str | None]
) -> None:
    assert detect_parsers(template, vocabulary, prefixes(template)) == expected


#: A line of each family's template that gives it away, and its vocabulary.
FAMILY_TEMPLATES = [
    (
        "<|tool_calls_section_begin|>{{ tool_calls }}<think>",
        {"<|tool_calls_section_begin|>", "<think>", "</think>"},
        ("kimi_k2", "kimi_k2"),
    ),
    (
        "<｜tool▁calls▁begin｜>{{ name }}\n```json",
        {"<｜tool▁calls▁begin｜>"},
        (None, "deepseek_v3"),
    ),
    (
        "<｜tool▁calls▁begin｜>{{ name }}<｜tool▁sep｜> <think>",
        {"<｜tool▁calls▁begin｜>", "<think>", "</think>"},
        ("deepseek_v3", "deepseek_v31"),
    ),
    ("<minimax:tool_call>\n<invoke name=", {"<minimax:tool_call>"}, (None, "minimax_m2")),
    (
        "<tool_call>{{ n }}\n<arg_key>k</arg_key>\n<arg_value>v</arg_value> think",
        {"<tool_call>", "<think>", "</think>"},
        ("glm45", "glm45"),
    ),
    (
        "<tool_call>{{ n }}<arg_key>k</arg_key><arg_value>v</arg_value>",
        {"<tool_call>"},
        (None, "glm47"),
    ),
    ("[TOOL_CALLS]{{ n }}[ARGS] [THINK]", {"[TOOL_CALLS]", "[THINK]"}, ("mistral", "mistral")),
    (
        'Respond with {"name": function name, "parameters": dictionary of argument name and its value}',
        {"a"},
        (None, "llama3_json"),
    ),
    ("[func_name1(params_name1=params_value1)]", {"a"}, (None, "pythonic")),
]


@pytest.mark.parametrize(("template", "vocabulary", "expected"), FAMILY_TEMPLATES)
def test_detect_each_family(
    template: str, vocabulary: set[str], expected: tuple[str | None, str | None]
) -> None:
    assert detect_parsers(template, vocabulary, ()) == expected


def test_a_template_without_its_tokens_is_not_detected() -> None:
    assert detect_parsers("<|tool_calls_section_begin|>", {"a"}, ()) == (None, None)


def prefixes(template: str | None) -> tuple[str, ...]:
    """The generation prefixes, rendered the server's one way (the tokenizer's
    chat template path), on a one-word tokenizer."""
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, "a")))
    return ChatTemplate(hf, template).generation_prefixes()


def test_generation_prefixes_follow_the_thinking_switch() -> None:
    assert prefixes(QWEN3_TEMPLATE) == (
        "<|im_start|>assistant",
        "<|im_start|>assistant",
        "<|im_start|>assistant<think>\n\n</think>",
    )
    assert prefixes(DEEPSEEK_TEMPLATE) == ("<\uff5cAssistant\uff5c><think>\n",) * 3
    assert prefixes("{{ broken") == ()
    assert prefixes(None) == ()


def test_detect_on_the_embedded_template() -> None:
    root = Path(__file__).resolve().parents[2]
    template = (root / "sluiceway/engines/data/chat_template.jinja").read_text()
    reasoning, tools = detect_parsers(template, THINK_VOCAB, prefixes(template))
    assert reasoning == "qwen3"
    assert tools == "hermes"
