"""Multi-turn prompts from the exact ids of an earlier reply (issue K).

Theory of operation. A trainer needs the prompt of turn N+1 to begin with
exactly the prompt ids of turn N and the ids the model generated in it;
re-rendering the history breaks that (reasoning templates drop past
``<think>`` blocks, and text -> ids is no round trip). So when an assistant
message carries the ids of its reply, the latest such message is not
rendered: the prompt is its ``prompt`` ids + ``generation`` ids + the ids of
what the template writes after it.

What the template writes after it comes from the template itself, by
difference, with a *stand-in*: the assistant message is replaced by one whose
whole content is a sentinel (no reasoning, no tool calls: those are in the
generated ids already). Rendering the history up to the stand-in (``A``) and
the whole conversation (``B``) gives

* the turn's *close*: what ``A`` holds after the sentinel (Qwen's
  ``<|im_end|>\\n``): the template's end of an assistant message;
* the *suffix*: ``B[len(A):]``, the later messages and the generation prompt,
  provided ``B`` extends ``A`` (else the template is not prefix-preserving
  for those messages: a 400 naming the first of them, never a silent splice).

The close is appended after the generated ids minus whatever of it they
already end with: a reply that ended on the end-of-turn token gets only the
newline after it; one stopped by a stop string or ``max_tokens`` gets the
whole close, as the template would write after that content.

The suffix is spliced as *text then tokenized* (close + suffix tokenized
together, once), not by diffing the ids of two full renders: the client's
ids are verbatim whatever the tokenizer does, so only the suffix is
tokenized, the way the tokenizer reads it on its own; the close leads so
that a tokenizer adding a prefix space sees the same start as in a full
render, and the check that the close's own ids lead the result proves that
the cut falls on a token boundary. It also costs one tokenization of the
new messages instead of two of the whole conversation.

Sans-IO and pure: the renderer and the tokenizer are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluiceway.surfaces.turns import Message, Role, ToolCall, TurnIds

#: Stands in for the assistant message whose ids are spliced; plain ASCII so
#: that no template escapes it, unlikely enough never to occur by accident.
SENTINEL = "SLUICEWAY-EXACT-TURN-7f3a91c2"

#: (messages, add_generation_prompt, continue_final_message) -> template text.
Render = Callable[[Sequence[Message], bool, bool], str]
Encode = Callable[[str], Sequence[int]]

PROMPT_IDS = "prompt_token_ids"
GENERATION_IDS = "generation_token_ids"


class TurnIdsError(Exception):
    """Ids the splice cannot use: which message (its index in the
    conversation), which field (None: the message itself) and why."""

    def __init__(self, index: int, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactPrompt:
    ids: tuple[int, ...]
    #: How many leading ids were taken verbatim from the client.
    reused: int


@dataclass(frozen=True, slots=True, kw_only=True)
class _Latest:
    index: int
    prompt: tuple[int, ...]
    generation: tuple[int, ...]


def _latest_with_ids(messages: Sequence[Message], vocab_size: int) -> _Latest | None:
    """Check every message's ids; the latest assistant message that carries
    them (None: no message does)."""
    latest = None
    for index, message in enumerate(messages):
        if message.ids is not None:
            latest = _check(index, message.role, message.ids, vocab_size)
    return latest


def _check(index: int, role: Role, ids: TurnIds, vocab_size: int) -> _Latest:
    fields = ((PROMPT_IDS, ids.prompt), (GENERATION_IDS, ids.generation))
    for name, values in fields:
        if values is None:
            present = PROMPT_IDS if name == GENERATION_IDS else GENERATION_IDS
            raise TurnIdsError(index, name, f"missing; it comes with {present}")
        if role is not Role.ASSISTANT:
            raise TurnIdsError(index, name, "only assistant messages carry token ids")
        for token in values:
            if not 0 <= token < vocab_size:
                raise TurnIdsError(
                    index, name, f"token id {token} is outside the vocabulary (0..{vocab_size - 1})"
                )
    if not ids.prompt:
        raise TurnIdsError(index, PROMPT_IDS, "must not be empty")
    return _Latest(index=index, prompt=ids.prompt, generation=ids.generation or ())


def splice(
    messages: Sequence[Message],
    *,
    render: Render,
    encode: Encode,
    vocab_size: int,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    extra_text: str = "",
) -> ExactPrompt | None:
    """The prompt ids that continue the latest assistant message with ids
    (None: no message carries ids; render as usual). ``extra_text`` is what
    the surface appends to the rendered text (a forced tool call's opening).

    Blocking (rendering, tokenizing): run it in a worker thread.
    """
    found = _latest_with_ids(messages, vocab_size)
    if found is None:
        return None
    latest = found.index
    reused = found.prompt + found.generation
    _check_leading(messages, latest, found.prompt, render, encode)
    if continue_final_message and latest == len(messages) - 1:
        # The reply is continued in place: nothing closes it.
        return ExactPrompt(ids=reused + tuple(encode(extra_text)), reused=len(reused))
    close, tail = _close_and_tail(
        messages, latest, render, encode, (add_generation_prompt, continue_final_message)
    )
    tail_ids = tuple(encode(close + tail + extra_text))
    close_ids = tuple(encode(close))
    if tail_ids[: len(close_ids)] != close_ids:
        raise TurnIdsError(
            _next(messages, latest),
            None,
            "the tokenizer merges the end of the assistant turn with what follows it; "
            "the ids cannot be extended cleanly",
        )
    return ExactPrompt(
        ids=reused + tail_ids[_overlap(found.generation, close_ids) :], reused=len(reused)
    )


def _next(messages: Sequence[Message], latest: int) -> int:
    return min(latest + 1, len(messages) - 1)


def _close_and_tail(
    messages: Sequence[Message],
    latest: int,
    render: Render,
    encode: Encode,
    flags: tuple[bool, bool],
) -> tuple[str, str]:
    """The template's close of the assistant turn, and what it renders after it."""
    history = (*messages[:latest], Message(role=Role.ASSISTANT, text=SENTINEL))
    before = render(history, False, False)
    after = render((*history, *messages[latest + 1 :]), *flags)
    at = before.rfind(SENTINEL)
    if at < 0:
        raise TurnIdsError(
            latest,
            None,
            "the chat template drops this assistant message's content, so "
            "its ids have no place in the prompt",
        )
    if not after.startswith(before):
        raise TurnIdsError(
            _next(messages, latest),
            None,
            "the chat template renders the history differently once this message follows "
            "(it is not prefix-preserving here), so the ids cannot be extended",
        )
    return before[at + len(SENTINEL) :], after[len(before) :]


def _check_leading(
    messages: Sequence[Message],
    latest: int,
    prompt: tuple[int, ...],
    render: Render,
    encode: Encode,
) -> None:
    """The prompt ids must begin with what the leading system messages and
    the first user message render to, when the client sends those too:
    ids from another conversation are reported, not guessed around."""
    count = 0
    for message in messages[:latest]:
        count += 1
        if message.role is Role.USER:
            break
        if message.role is not Role.SYSTEM:
            count -= 1
            break
    if count == 0:
        return
    expected = tuple(encode(render(messages[:count], False, False)))
    if prompt[: len(expected)] != expected:
        raise TurnIdsError(
            latest,
            PROMPT_IDS,
            f"it does not begin with what messages 0..{count - 1} render to "
            f"({len(expected)} ids); these ids belong to another conversation",
        )


def _overlap(generation: Sequence[int], close: Sequence[int]) -> int:
    """How many of the close's leading ids the generated ids already end with
    (a reply that ended on the end-of-turn token has written that part)."""
    for length in range(min(len(close), len(generation)), 0, -1):
        if tuple(generation[-length:]) == tuple(close[:length]):
            return length
    return 0


#: The histories the start-up probe renders: an assistant turn that reasoned
#: and then answered (a user message follows) or called a tool (its result
#: follows). Reasoning is where templates most often rewrite history.
_PROBE_USER = Message(role=Role.USER, text="What is 2 + 2?")
_PROBE_ANSWER = Message(role=Role.ASSISTANT, reasoning="Two and two.", text="4")
_PROBE_CALL = Message(
    role=Role.ASSISTANT,
    reasoning="I should use the tool.",
    tool_calls=(ToolCall(id="call_probe", name="add", arguments='{"a": 2, "b": 2}'),),
)
_PROBES = {
    "user": ((_PROBE_USER, _PROBE_ANSWER), Message(role=Role.USER, text="And 3 + 3?")),
    "tool": (
        (_PROBE_USER, _PROBE_CALL),
        Message(role=Role.TOOL, text="4", tool_call_id="call_probe", name="add"),
    ),
}


def prefix_preserving(render: Render) -> dict[str, bool | None]:
    """Whether re-rendering keeps the earlier prompt as a prefix when a user
    message (``user``) or a tool result (``tool``) follows an assistant turn
    that reasoned: the history rendered on its own must begin the rendering
    with the new message and the generation prompt. None: the template
    cannot render the probe. Where it is False, only the ids keep the
    multi-turn invariant."""
    results: dict[str, bool | None] = {}
    for name, (history, new) in _PROBES.items():
        try:
            before = render(history, False, False)
            after = render((*history, new), True, False)
        except Exception:  # a template that cannot render the probe tells nothing
            results[name] = None
            continue
        results[name] = after.startswith(before)
    return results
