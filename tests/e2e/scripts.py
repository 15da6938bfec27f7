"""Scripts the end-to-end scripted model follows, beyond the fixture's examples."""

from __future__ import annotations

from tests.fixtures.scripted_model import EXAMPLE_SCRIPTS, Script

#: Continues the prefix that forces ``get_weather`` (tool_choice by name).
FORCED_NAMED = Script(
    "named",
    (
        "<tool_call>", "\n", '{"name": ', '"get_weather"', ', "arguments": ',
        '{"city": "Oslo"}', "}", "\n</tool_call>",
    ),
)  # fmt: skip

#: Continues the prefix that forces some call (tool_choice "required").
FORCED_REQUIRED = Script(
    "required",
    ("<tool_call>", "\n", '{"name": "', "get_time", '", "arguments": ', '{"tz": "UTC"}', "}\n", "</tool_call>"),
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

#: A call whose arguments are not JSON (a bare word where a string belongs).
BAD_ARGUMENTS = Script(
    "bad_arguments",
    ("<tool_call>", "\n", '{"name": ', '"get_weather"', ', "arguments": ', '{"city": ', "Paris", "}}\n", "</tool_call>"),
)  # fmt: skip

ALL_SCRIPTS = (*EXAMPLE_SCRIPTS, FORCED_NAMED, FORCED_REQUIRED, PLAYGROUND, BAD_ARGUMENTS)
