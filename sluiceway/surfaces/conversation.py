"""The surface-neutral conversation: messages, tools and a tool-choice mode
-> prompt ids and the options of each choice's text path.

Every chat-like surface (OpenAI chat, Anthropic Messages, OpenAI Responses)
maps its own message shapes onto :class:`Message` and calls
:func:`render_conversation`; the chat template is rendered by the tokenizer
(``ModelTokenizer.chat``, the one renderer), and what a forced tool call
appends to the prompt comes from the parser registry.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluiceway.engines.tokenizer import ChatRender, ModelTokenizer
from sluiceway.parsers.registry import (
    TextPathOptions,
    ToolSchema,
    forced_reasoning_close,
    forced_tool_prefix,
)
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces.base import Serving
from sluiceway.surfaces.exact_turns import (
    ExactPrompt,
    Render,
    TurnIdsError,
    prefix_preserving,
    splice,
)
from sluiceway.surfaces.turns import Message as Message
from sluiceway.surfaces.turns import Role as Role
from sluiceway.surfaces.turns import ToolCall as ToolCall
from sluiceway.surfaces.turns import TurnIds as TurnIds
from sluiceway.surfaces.turns import turn_ids as turn_ids


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A function the model may call."""

    name: str
    description: str | None = None
    #: The arguments' JSON schema.
    parameters: Mapping[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolChoice:
    mode: ToolChoiceMode
    #: The function a NAMED choice forces.
    name: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    #: None: the request did not say (tools, if any, are offered: AUTO).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    #: Extra variables for the chat template (``enable_thinking``, say).
    template_kwargs: Mapping[str, Any] | None = None
    #: Render the generation prompt (the assistant turn's opening) after the messages.
    add_generation_prompt: bool = True
    #: Leave the final message open for the model to continue (no generation prompt).
    continue_final_message: bool = False
    #: The template's thinking switch (:data:`THINKING_SWITCH`); None: leave
    #: it to the template (or the server's defaults). ``template_kwargs``
    #: override it.
    thinking: bool | None = None
    #: The template's reasoning level (:data:`EFFORT_VARIABLE`: low, medium or
    #: high); None: the template's default. ``template_kwargs`` override it.
    effort: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationParams:
    """The names a surface gives these fields, for its errors."""

    messages: str = "messages"
    tools: str = "tools"
    tool_choice: str = "tool_choice"
    #: A tool's arguments schema; ``{index}`` is the tool's place in the list.
    tool_parameters: str = "tools[{index}].function.parameters"
    #: Where each neutral message came from, for a surface whose items do
    #: not map one to one onto messages (``input[4]``); empty: ``messages[i]``.
    locations: tuple[str, ...] = ()
    #: Each offered tool's arguments schema by name, where the tools offered
    #: are not the request's list (the Responses API's namespaces and hosted
    #: tools); a tool not in it falls back on ``tool_parameters``.
    tool_parameter_names: Mapping[str, str] = field(default_factory=dict)

    def tool_param(self, index: int, name: str) -> str:
        """The field holding the arguments schema of offered tool ``index``, ``name``."""
        return self.tool_parameter_names.get(name) or self.tool_parameters.format(index=index)

    def message_field(self, index: int, name: str | None) -> str:
        """A field of one message (``messages[3].prompt_token_ids``)."""
        where = self.locations[index] if self.locations else f"{self.messages}[{index}]"
        return where if name is None else f"{where}.{name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class StopOptions:
    """The text-level ends of generation (stop strings)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


#: The chat template variable that turns thinking on or off (Qwen3's name,
#: which the project's templates and most hybrid-thinking models read).
THINKING_SWITCH = "enable_thinking"
#: The chat template variable of the reasoning level (gpt-oss's name, which
#: vLLM sets from ``reasoning_effort`` too).
EFFORT_VARIABLE = "reasoning_effort"

#: Characters no tokenizer takes: halves of UTF-16 surrogate pairs, which a
#: JSON body can carry (``"\ud83d"`` alone) and Python keeps.
_LONE_SURROGATES = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    ids: tuple[int, ...]
    options: TextPathOptions
    #: How many leading ids were the client's own (an assistant message's
    #: ``prompt_token_ids`` + ``generation_token_ids``); None: none were sent.
    reused: int | None = None


def render_conversation(
    serving: Serving,
    conversation: Conversation,
    stops: StopOptions,
    params: ConversationParams = ConversationParams(),
    *,
    tools_by_grammar: bool = False,
) -> RenderedPrompt:
    """Render the conversation through the chat template and tokenize it.

    A required tool call is forced by a prefix appended to the prompt,
    unless ``tools_by_grammar``: then the caller constrains the reply with
    a grammar instead (``sluiceway.surfaces.structured``).

    Blocking (template rendering and tokenization): run it in a worker thread.
    """
    parse_tools, forced = _tool_mode(serving, conversation, params)
    rendered = _render(serving, conversation, params)
    parsers = serving.parsers
    forced_prefix = ""
    if forced is not None and parsers.tools is not None and not tools_by_grammar:
        forced_prefix = forced_reasoning_close(parsers.reasoning, rendered.assistant_prefix)
        forced_prefix += forced_tool_prefix(parsers.tools, forced or None)
    options = TextPathOptions(
        reasoning_parser=parsers.reasoning,
        tool_parser=parsers.tools if parse_tools else None,
        tools=tuple(
            ToolSchema(name=tool.name, parameters=dict(tool.parameters or {}))
            for tool in conversation.tools
        ),
        parallel_tool_calls=conversation.parallel_tool_calls,
        stop=stops.stop,
        include_stop_str_in_output=stops.include_stop_str_in_output,
        min_tokens=stops.min_tokens,
        stop_in_reasoning=serving.stop_in_reasoning,
        assistant_prefix=rendered.assistant_prefix,
        forced_prefix=forced_prefix,
    )
    exact = _exact(serving, conversation, forced_prefix, params)
    if exact is not None:
        return RenderedPrompt(exact.ids, options, exact.reused)
    return RenderedPrompt(tuple(_encode(serving, rendered.text + forced_prefix)), options)


def _encode(serving: Serving, text: str) -> list[int]:
    return serving.tokenizer.encode(_LONE_SURROGATES.sub("\ufffd", text))


def _exact(
    serving: Serving,
    conversation: Conversation,
    forced_prefix: str,
    params: ConversationParams,
) -> ExactPrompt | None:
    """The prompt from an assistant message's own ids (None: no message has
    any). The splice renders the messages as they stand (no system folding:
    its errors name messages by their index)."""
    try:
        return splice(
            conversation.messages,
            render=lambda messages, generation, continued: (
                _apply(serving, conversation, messages, params, (generation, continued)).text
            ),
            encode=lambda text: _encode(serving, text),
            vocab_size=serving.vocab_size,
            add_generation_prompt=conversation.add_generation_prompt,
            continue_final_message=conversation.continue_final_message,
            extra_text=forced_prefix,
        )
    except TurnIdsError as error:
        where = params.message_field(error.index, error.field)
        raise InvalidRequest(f"{where}: {error.reason}", param=where) from error


def template_kwargs(serving: Serving, conversation: Conversation) -> dict[str, Any]:
    """The chat template's variables: the server's defaults, the thinking
    switch, then the conversation's own, each overriding the one before."""
    switch: dict[str, Any] = {}
    if conversation.thinking is not None:
        switch[THINKING_SWITCH] = conversation.thinking
    if conversation.effort is not None:
        switch[EFFORT_VARIABLE] = conversation.effort
    return {
        **serving.default_template_kwargs,
        **switch,
        **(conversation.template_kwargs or {}),
    }


def _render(serving: Serving, conversation: Conversation, params: ConversationParams) -> ChatRender:
    """The chat template's rendering of the conversation.

    A system message after the first message is rendered where it stands
    when the template does so (it renders, and shows the message's text);
    otherwise -- many templates refuse a system message anywhere but first,
    or drop it -- every system message is folded into the leading one.
    """
    messages = conversation.messages
    late = [message for message in messages[1:] if message.role is Role.SYSTEM]
    try:
        rendered = _apply(serving, conversation, messages, params)
    except InvalidRequest:
        if not late:
            raise
    else:
        if all(message.text.strip() in rendered.text for message in late):
            return rendered
    return _apply(serving, conversation, _fold_systems(messages), params)


def _fold_systems(messages: Sequence[Message]) -> tuple[Message, ...]:
    """The conversation with every system message's text in one leading
    system message (joined by blank lines, in order)."""
    systems = [message.text for message in messages if message.role is Role.SYSTEM]
    others = tuple(message for message in messages if message.role is not Role.SYSTEM)
    return (Message(role=Role.SYSTEM, text="\n\n".join(systems)), *others)


def _apply(
    serving: Serving,
    conversation: Conversation,
    messages: Sequence[Message],
    params: ConversationParams,
    flags: tuple[bool, bool] | None = None,
) -> ChatRender:
    """Render ``messages`` with the conversation's tools and variables;
    ``flags``: (add_generation_prompt, continue_final_message) other than
    the conversation's."""
    offered = () if _mode(conversation) is ToolChoiceMode.NONE else conversation.tools
    render = _bound(serving.tokenizer, template_kwargs(serving, conversation), offered)
    if flags is None:
        flags = (conversation.add_generation_prompt, conversation.continue_final_message)
    try:
        return render(messages, *flags)
    except Exception as error:  # template errors are the conversation's fault
        raise InvalidRequest(
            f"the chat template could not render these messages: {error}", param=params.messages
        ) from error


#: (messages, add_generation_prompt, continue_final_message) -> the rendering.
_ChatRenderer = Callable[[Sequence[Message], bool, bool], ChatRender]


def _bound(
    tokenizer: ModelTokenizer, template_kwargs: Mapping[str, Any], tools: Sequence[ToolSpec]
) -> _ChatRenderer:
    """The one chat template, bound to the tools and template variables."""
    offered = [_template_tool(tool) for tool in tools]

    def render(messages: Sequence[Message], generation_prompt: bool, continued: bool) -> ChatRender:
        return tokenizer.chat.render(
            [_template_message(message) for message in messages],
            tools=offered,
            template_kwargs=template_kwargs,
            add_generation_prompt=generation_prompt,
            continue_final_message=continued,
        )

    return render


def template_renderer(
    tokenizer: ModelTokenizer, template_kwargs: Mapping[str, Any], tools: Sequence[ToolSpec] = ()
) -> Render:
    """The chat template as the splice and the probes call it: neutral
    messages and the two flags -> the rendered text."""
    bound = _bound(tokenizer, template_kwargs, tools)
    return lambda messages, generation, continued: bound(messages, generation, continued).text


def template_probes(
    tokenizer: ModelTokenizer, template_kwargs: Mapping[str, Any]
) -> dict[str, bool | None]:
    """Whether the served template is prefix-preserving for a user message
    and a tool result after an assistant turn (``/tokenizer_info``); run
    once at start-up. Empty when the model has no chat template."""
    if not tokenizer.chat.source:
        return {}
    return prefix_preserving(template_renderer(tokenizer, template_kwargs))


def _mode(conversation: Conversation) -> ToolChoiceMode:
    choice = conversation.tool_choice
    return ToolChoiceMode.AUTO if choice is None else choice.mode


def _tool_mode(
    serving: Serving, conversation: Conversation, params: ConversationParams
) -> tuple[bool, str | None]:
    """Whether tool calls are parsed, and the function a call is forced to
    (``""`` for REQUIRED: any function)."""
    choice = conversation.tool_choice
    mode = _mode(conversation)
    if not conversation.tools:
        if choice is not None and mode is not ToolChoiceMode.NONE:
            raise InvalidRequest(f"{params.tool_choice} needs tools", param=params.tool_choice)
        return False, None
    if mode is ToolChoiceMode.NONE:
        return False, None
    if serving.parsers.tools is None:
        raise InvalidRequest(
            "this server has no tool-call parser for this model (start it with --tool-call-parser)",
            param=params.tools,
        )
    if mode is ToolChoiceMode.NAMED:
        name = choice.name if choice is not None else None
        if name not in {tool.name for tool in conversation.tools}:
            raise InvalidRequest(
                f"{params.tool_choice} names {name!r}, which is not among the tools",
                param=params.tool_choice,
            )
        return True, name
    return True, "" if mode is ToolChoiceMode.REQUIRED else None


def _template_message(message: Message) -> dict[str, Any]:
    """A message as chat templates read it (the Hugging Face convention)."""
    item: dict[str, Any] = {"role": message.role.value, "content": message.text}
    if message.name:
        item["name"] = message.name
    if message.tool_calls:
        item["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        item["tool_call_id"] = message.tool_call_id
    if message.reasoning:
        item["reasoning_content"] = message.reasoning
    if message.is_error:
        # No template convention exists; one that knows the key can use it.
        item["is_error"] = True
    return item


def _template_tool(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = dict(tool.parameters)
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}
