"""The grammar of a harmony (gpt-oss) reply under structured output or tool rules.

The reply is a run of free messages (``analysis`` reasoning, ``commentary``
preambles), each closed by ``<|end|><|start|>assistant``, and then its end:
the ``final`` message, whose body the format constrains (or free text), or
one call ``commentary to=functions.NAME``, whose body is the tool's
arguments (its schema, where it has one that compiles). Reasoning and
preambles stay free text; only the final answer and the calls are held.
Markers are the model's special tokens (``<[id]>``), which no text matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sluiceway.engines.grammar import lark_json, lark_literal
from sluiceway.parsers.harmony import Marker
from sluiceway.surfaces.tool_grammar import CallableTool

#: Text of a free message body: anything (markers are tokens, never text).
_FREE = "/(?s:.*)/"


def harmony_grammar(
    markup: Callable[[str], str],
    *,
    final: str | None,
    tools: Sequence[CallableTool] = (),
    answer: bool = True,
) -> str:
    """A Lark grammar of the reply: ``final`` is the rule of the final
    answer's body (None: free); ``tools`` may be called; ``answer=False``
    leaves no final answer (a call is required)."""
    channel, message = markup(Marker.CHANNEL.value), markup(Marker.MESSAGE.value)
    typed = f'(" "? {markup(Marker.CONSTRAIN.value)} "json" | " json")?'
    ends = (["final"] if answer or not tools else []) + [f"call_{i}" for i in range(len(tools))]
    lines = [
        "start: free* (" + " | ".join(ends) + ")",
        f'free: {channel} ("analysis" | "commentary") {message} FREE '
        f'{markup(Marker.END.value)} {markup(Marker.START.value)} "assistant"',
        f"FREE: {_FREE}",
        f'final: {channel} "final" {typed} {message} {final or "FREE"}',
    ]
    for index, tool in enumerate(tools):
        recipient = lark_literal(f"commentary to=functions.{tool.name}")
        arguments = lark_json(tool.parameters or {"type": "object"})
        lines.append(f"call_{index}: {channel} {recipient} {typed} {message} {arguments}")
    return "\n".join(lines) + "\n"
