"""A Messages request in neutral terms: its conversation (system prompt,
messages and blocks, tools, tool choice, the thinking switch, thinking left
out of the history), its stop sequences and sampling.

Text blocks of one message are concatenated as they are; tool results become
tool messages at their place; an assistant message's thinking blocks become
its reasoning and its ``tool_use`` blocks its tool calls, whatever order the
blocks came in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace

from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces import validation
from sluiceway.surfaces.anthropic.wire import (
    ContentBlock,
    ContextManagement,
    ConversationFields,
    DocumentBlock,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBetweenTools,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ThinkingTurns,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceParam,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlock,
    ToolResultPart,
    ToolUseBlock,
)
from sluiceway.surfaces.conversation import (
    Conversation,
    ConversationParams,
    Message,
    Role,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    turn_ids,
)
from sluiceway.surfaces.reasoning import (
    Effort,
    keep_recent_reasoning,
    reasoning_level,
    thinking_for_effort,
)

_ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT, "system": Role.SYSTEM}

#: The context-management edit that clears earlier thinking (any version).
_CLEAR_THINKING = "clear_thinking_"
#: Anthropic's default for that edit: the last assistant turn keeps its thinking.
_DEFAULT_THINKING_TURNS = 1


def conversation_of(request: ConversationFields) -> Conversation:
    """The request's conversation in neutral terms (400 for what this server
    cannot take: images, documents, server tools, an output format)."""
    return conversation_and_params(request)[0]


def conversation_and_params(
    request: ConversationFields,
) -> tuple[Conversation, ConversationParams]:
    """The conversation, and where each neutral message came from (a user
    message with tool results becomes several): errors name the client's
    own message (``messages[2].prompt_token_ids``)."""
    if request.output_config is not None and request.output_config.format is not None:
        raise InvalidRequest(
            "output_config.format (structured output) is not supported yet",
            param="output_config.format",
        )
    messages, locations = _turns(request)
    choice = request.tool_choice
    conversation = Conversation(
        messages=_clear_thinking(messages, request.context_management),
        tools=tuple(
            _tool(tool, f"tools[{index}]") for index, tool in enumerate(request.tools or ())
        ),
        tool_choice=None if choice is None else _tool_choice(choice),
        parallel_tool_calls=choice is None or not choice.disable_parallel_tool_use,
        template_kwargs=request.chat_template_kwargs,
        thinking=_thinking(request),
        effort=reasoning_level(request.output_config.effort if request.output_config else None),
    )
    return conversation, ConversationParams(locations=tuple(locations))


def stop_strings(request: MessagesRequest) -> tuple[str, ...]:
    return validation.stop_strings(request.stop_sequences or (), param="stop_sequences")


def sampling(request: MessagesRequest) -> validation.Sampling:
    return validation.Sampling(
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k
    )


# --- messages -----------------------------------------------------------------


def _turns(request: ConversationFields) -> tuple[list[Message], list[str]]:
    """The system prompt and messages as neutral turns, and where each came from."""
    messages: list[Message] = []
    locations: list[str] = []
    if request.system:
        messages.append(Message(role=Role.SYSTEM, text=_text(request.system, "system")))
        locations.append("system")
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        turns = list(_messages(message, where))
        # The ids go on the message's first turn; on a user message they are
        # the core's to refuse.
        ids = turn_ids(message.prompt_token_ids, message.generation_token_ids)
        turns[0] = replace(turns[0], ids=ids)
        messages += turns
        locations += [where] * len(turns)
    return messages, locations


def _messages(message: MessageParam, param: str) -> Iterator[Message]:
    role = _ROLES[message.role]
    if isinstance(message.content, str):
        yield Message(role=role, text=message.content)
        return
    blocks = message.content
    if role is Role.ASSISTANT:
        yield _assistant(blocks, param)
        return
    text: list[str] = []
    for index, block in enumerate(blocks):
        where = f"{param}.content[{index}]"
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock) and role is Role.USER:
            if text:  # text before a tool result stays before it
                yield Message(role=role, text="".join(text))
                text = []
            yield _tool_result(block, where)
        else:
            _refuse(block, where, f"a {message.role} message")
    if text or not blocks:
        yield Message(role=role, text="".join(text))


def _assistant(blocks: Sequence[ContentBlock], param: str) -> Message:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCall(id=block.id, name=block.name, arguments=arguments))
        elif not isinstance(block, RedactedThinkingBlock):  # opaque: left out
            _refuse(block, f"{param}.content[{index}]", "an assistant message")
    return Message(
        role=Role.ASSISTANT,
        text="".join(text),
        reasoning="".join(reasoning),
        tool_calls=tuple(calls),
    )


def _tool_result(block: ToolResultBlock, param: str) -> Message:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = _text(content, f"{param}.content")
    return Message(
        role=Role.TOOL, text=text, tool_call_id=block.tool_use_id, is_error=block.is_error
    )


def _text(blocks: str | Sequence[ToolResultPart | TextBlock], param: str) -> str:
    if isinstance(blocks, str):
        return blocks
    for index, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            _refuse(block, f"{param}[{index}]", param)
    return "".join(block.text for block in blocks if isinstance(block, TextBlock))


def _refuse(block: ContentBlock, param: str, place: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        raise InvalidRequest(
            f"{param}: {block.type} blocks are not supported: this server's model reads text only",
            param=param,
        )
    raise InvalidRequest(f"{param}: a {block.type} block cannot be in {place}", param=param)


def _clear_thinking(
    messages: list[Message], management: ContextManagement | None
) -> tuple[Message, ...]:
    """The history with thinking cleared as a ``clear_thinking_*`` edit asks."""
    for index, edit in enumerate(management.edits if management else ()):
        if not edit.type.startswith(_CLEAR_THINKING):
            continue  # clearing tool results and other edits: accepted, ignored
        keep = edit.keep
        if keep == "all":
            continue
        if keep is None:
            turns = _DEFAULT_THINKING_TURNS
        elif isinstance(keep, ThinkingTurns):
            turns = keep.value
        else:
            param = f"context_management.edits[{index}].keep"
            raise InvalidRequest(
                f'{param} must be "all" or {{"type": "thinking_turns", "value": N}}', param=param
            )
        return keep_recent_reasoning(messages, turns)
    return tuple(messages)


# --- tools and thinking ---------------------------------------------------------


def _tool(tool: ToolParam, param: str) -> ToolSpec:
    if tool.type not in (None, "custom"):
        raise InvalidRequest(
            f"{param}: the server tool {tool.type!r} is not supported; this server runs "
            "client tools (name, description, input_schema)",
            param=f"{param}.type",
        )
    return ToolSpec(
        name=tool.name,
        description=tool.description,
        parameters=tool.input_schema,
        strict=tool.strict,
    )


def _tool_choice(choice: ToolChoiceParam) -> ToolChoice:
    if isinstance(choice, ToolChoiceTool):
        return ToolChoice(mode=ToolChoiceMode.NAMED, name=choice.name)
    if isinstance(choice, ToolChoiceAny):
        return ToolChoice(mode=ToolChoiceMode.REQUIRED)
    if isinstance(choice, ToolChoiceNone):
        return ToolChoice(mode=ToolChoiceMode.NONE)
    return ToolChoice(mode=ToolChoiceMode.AUTO)


def _thinking(request: ConversationFields) -> bool | None:
    """The template's thinking switch: ``enabled`` and ``disabled`` say it;
    ``adaptive`` (the model decides) thinks unless the effort is low; no
    ``thinking`` at all leaves it to the template, unless the effort is low."""
    config = request.output_config
    effort = None if config is None or config.effort is None else Effort(config.effort)
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled):
        return True
    if isinstance(thinking, ThinkingDisabled):
        return False
    if isinstance(thinking, ThinkingAdaptive | ThinkingBetweenTools):
        return effort is None or thinking_for_effort(effort)
    if effort is not None and not thinking_for_effort(effort):
        return False
    return None
