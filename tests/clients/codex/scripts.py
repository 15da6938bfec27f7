"""The scripts the model follows for the Codex CLI test: a tool call, then,
once the tool's output is carried back, the final answer.

A real client cannot send ``chat_template_kwargs``, so the scripts are
selected by their selector special token in the text the client sends: the
user's prompt holds ``<|script:codex_call|>``; the command the model calls
prints ``<|script:codex_done|>`` (from two halves, so that only the tool's
output holds it, not the call), and that selector outranks the first
(``priority=1``). The model thus answers only if the tool's output reached
it.

As for the agent scripts in ``tests/e2e/scripts.py``, each script's first
piece is the generation prompt's last token (``PROMPT_END``).

The harmony scripts are the same loop in gpt-oss's format, for the trained
model of ``tests/fixtures/harmony_model.py``: its template finds a selector
in any message's text (the last one wins, so the tool's output outranks the
prompt). Their words are in neither their prompt nor Codex's: a trained
model copies text it has seen and goes off its script.
"""

from __future__ import annotations

from tests.e2e.scripts import PROMPT_END
from tests.fixtures.harmony_model import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from tests.fixtures.scripted_model import Script

#: The marker the tool prints; it selects :data:`CODEX_DONE`.
DONE_SELECTOR = "<|script:codex_done|>"

CODEX_CALL = Script(
    "codex_call",
    (
        PROMPT_END, "<think>", "\nRun", " the check", ".\n", "</think>", "\n\n",
        "<tool_call>", "\n{", '"name": ', '"exec_command"', ', "arguments": ', '{"cmd": ',
        '"printf %s%s', " '<|script:'", " 'codex_done|>'", '"}', "}\n", "</tool_call>",
    ),
)  # fmt: skip

CODEX_DONE = Script(
    "codex_done",
    (
        PROMPT_END, "<think>", "\nThe check", " printed", " its marker", ".\n", "</think>",
        "\n\n", "Done", ": the", " check", " ran.",
    ),
    priority=1,
)  # fmt: skip

#: The answer Codex prints last.
FINAL_ANSWER = "Done: the check ran."

CODEX_SCRIPTS = (CODEX_CALL, CODEX_DONE)

#: Codex's first request is about 40 KB, a token per byte for this model's
#: tokenizer outside its scripted pieces.
MAX_POSITIONS = 65536


HARMONY_CALL = Script(
    "codex_call",
    (
        CHANNEL, "analysis", MESSAGE, "Calling", " exec", " now", ".", END,
        START, "assistant", CHANNEL, "commentary", " to=functions.exec_command", " ", CONSTRAIN,
        "json", MESSAGE, '{"cmd": ', '"printf %s%s', " '<|script:'", " 'codex_done|>'", '"}',
        CALL,
    ),
)  # fmt: skip

HARMONY_DONE = Script(
    "codex_done",
    (
        CHANNEL, "analysis", MESSAGE, "Marker", " came", " back", ".", END,
        START, "assistant", CHANNEL, "final", MESSAGE, "All", " seen", ":", " ok", ".", RETURN,
    ),
)  # fmt: skip

HARMONY_SCRIPTS = (HARMONY_CALL, HARMONY_DONE)
HARMONY_PROMPT = "Go ahead. <|script:codex_call|>"
HARMONY_ANSWER = "All seen: ok."
#: The harmony model's attention window (gpt-oss's): a Codex request is
#: thousands of tokens, and a model this small trained on short prompts
#: cannot find its selector in that many unless it sees only the last ones.
HARMONY_WINDOW = 128
