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

#: A call whose arguments are not JSON (a bare word where a string belongs).
BAD_ARGUMENTS = Script(
    "bad_arguments",
    ("<tool_call>", "\n", '{"name": ', '"get_weather"', ', "arguments": ', '{"city": ', "Paris", "}}\n", "</tool_call>"),
)  # fmt: skip

# -- Responses API -------------------------------------------------------------

#: Calls a member of a ``namespace`` tool under its qualified name.
NAMESPACED = Script(
    "namespaced",
    (
        "<tool_call>", "\n", '{"name": ', '"multi_agent_v1__wait_agent"', ', "arguments": ',
        '{"targets": ', '["agent-1"]', "}}\n", "</tool_call>",
    ),
)  # fmt: skip

#: Calls a ``custom`` tool (offered as a function with one string, ``input``).
CUSTOM_CALL = Script(
    "custom_call",
    (
        "<think>", "\nPatch", " it", ".\n", "</think>", "\n\n",
        "<tool_call>", "\n", '{"name": ', '"apply_patch"', ', "arguments": ', '{"input": ',
        '"*** Begin Patch\\n', '*** End Patch\\n"', "}}\n", "</tool_call>",
    ),
)  # fmt: skip

#: The input :data:`CUSTOM_CALL` gives ``apply_patch``.
CUSTOM_INPUT = "*** Begin Patch\n*** End Patch\n"

# Scripts that a client selects through the text it sends (a real client
# cannot send chat_template_kwargs): the selector sits in the prompt, not at
# its end, so each script's first piece is the generation prompt's last token
# (the newline after ``<|im_start|>assistant``) and generation continues from
# there. A tool's output carries the next script's selector, which outranks
# the first (priority 1): the model answers only once that output reaches it.

#: The generation prompt's last token.
PROMPT_END = "\n"

#: The agent's first turn: a call to ``get_weather``.
AGENT_CALL = Script(
    "agent_call",
    (
        PROMPT_END, "<think>", "\nLook", " it up", ".\n", "</think>", "\n\n",
        "<tool_call>", "\n{", '"name": ', '"get_weather"', ', "arguments": ', '{"city": ',
        '"Oslo"', "}}\n", "</tool_call>",
    ),
)  # fmt: skip

#: The same call as hermes models also write it: no newline after
#: ``<tool_call>`` (the strict-tool grammar once demanded one and forced the
#: model's arguments into garbage).
AGENT_CALL_TIGHT = Script(
    "agent_call_tight",
    (
        PROMPT_END, "<think>", "\nLook", " it", " up.\n", "</think>", "\n\n",
        "<tool_call>", '{"name": "get_weather", "arguments": ', '{"city": "Oslo"}', "}",
        "</tool_call>",
    ),
)  # fmt: skip

#: The agent's answer, once the tool's output (holding this selector) is back.
AGENT_DONE = Script(
    "agent_done",
    (
        PROMPT_END, "<think>", "\nGot", " the weather", ".\n", "</think>", "\n\n",
        "Oslo", " is", " sunny", ".",
    ),
    priority=1,
)  # fmt: skip

RESPONSES_SCRIPTS = (NAMESPACED, CUSTOM_CALL, AGENT_CALL, AGENT_CALL_TIGHT, AGENT_DONE)


ALL_SCRIPTS = (
    *EXAMPLE_SCRIPTS,
    FORCED_NAMED,
    FORCED_REQUIRED,
    PLAYGROUND,
    JSON_AFTER_REASONING,
    STRICT_CALL,
    CODER_CALL,
    BAD_ARGUMENTS,
    *RESPONSES_SCRIPTS,
)
