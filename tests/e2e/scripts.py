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

#: The agent's answer, once the tool's output (holding this selector) is back.
AGENT_DONE = Script(
    "agent_done",
    (
        PROMPT_END, "<think>", "\nGot", " the weather", ".\n", "</think>", "\n\n",
        "Oslo", " is", " sunny", ".",
    ),
    priority=1,
)  # fmt: skip

RESPONSES_SCRIPTS = (NAMESPACED, CUSTOM_CALL, AGENT_CALL, AGENT_DONE)

ALL_SCRIPTS = (*EXAMPLE_SCRIPTS, FORCED_NAMED, FORCED_REQUIRED, PLAYGROUND, *RESPONSES_SCRIPTS)
