"""Scripts the end-to-end scripted model follows, beyond the fixture's examples."""

from __future__ import annotations

from tests.fixtures.scripted_model import EXAMPLE_SCRIPTS, Script

#: A call of ``get_weather`` (tool_choice by name; the forced prompt
#: prefix where the server has no grammar engine).
FORCED_NAMED = Script(
    "named",
    (
        "<tool_call>", "\n", '{"name": ', '"get_weather"', ', "arguments": ',
        '{"city": "Oslo"}', "}", "\n</tool_call>",
    ),
)  # fmt: skip

#: Some call (tool_choice "required"). The grammar holds the call's
#: envelope to the tokens the tokenizer makes of it where it allows only
#: one way on (llguidance's forced, canonical tokens), so the script
#: splits it as the tokenizer does.
FORCED_REQUIRED = Script(
    "required",
    ("<tool_call>", "\n", '{"name": ', '"get_time"', ', "arguments": ', '{"tz": "UTC"}', "}\n", "</tool_call>"),
)  # fmt: skip

#: Reasoning, content, then a hermes tool call: every channel in one reply (the
#: playground's browser tests). Markup: <think>, </think>, the dropped "\n\n",
#: the call's envelope (<tool_call>, "\n", the name, the keys), </tool_call>, EOS.
PLAYGROUND = Script(
    "playground",
    (
        "<think>", "\nThe user", " wants", " the weather", " in Paris", ".\n", "</think>", "\n\n",
        "Checking", " the forecast", " for you", ".",
        "<tool_call>", "\n", '{"name": ', '"get_weather"', ', "arguments": ',
        '{"city": ', '"Paris"', "}}\n", "</tool_call>",
    ),
)  # fmt: skip

#: Reasoning that is no JSON at all, then a valid document: under a
#: response_format the reasoning stays free and the content is the script's.
JSON_AFTER_REASONING = Script(
    "json_after_reasoning",
    ("<think>", "\nThey", " want", " JSON", ":", " {oops", ".\n", "</think>", '{"answer": ', '"yes"', "}"),
)  # fmt: skip

#: Text, then a call whose scripted arguments break a strict tool's schema
#: (a unit of "kelvin"): the grammar holds them to it.
STRICT_CALL = Script(
    "strict_call",
    (
        "Let me check", ".", "<tool_call>", "\n", '{"name": ', '"get_weather"', ', "arguments": ',
        '{"city": ', '"Paris"', ', "unit": ', '"kelvin"', "}", "}\n", "</tool_call>",
    ),
)  # fmt: skip

#: A qwen3_coder call whose "days" are not an integer. Where the grammar
#: allows one way on, it takes the tokenizer's tokens of that text (see
#: FORCED_REQUIRED): the envelope up to the first value is one piece.
CODER_CALL = Script(
    "coder_call",
    (
        "<tool_call>", "\n<function=get_weather>\n<parameter=city>\n", "Oslo",
        "\n</parameter>\n", "<parameter=days>\n", "three", "\n</function>\n", "</tool_call>",
    ),
)  # fmt: skip

ALL_SCRIPTS = (
    *EXAMPLE_SCRIPTS,
    FORCED_NAMED,
    FORCED_REQUIRED,
    PLAYGROUND,
    JSON_AFTER_REASONING,
    STRICT_CALL,
    CODER_CALL,
)
