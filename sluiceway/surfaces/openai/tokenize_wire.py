"""Wire models of ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, in
the shapes of vLLM's OpenAI-compatible server."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

from sluiceway.surfaces.openai.chat_wire import ChatMessage, NamedToolChoice, ToolSpec
from sluiceway.surfaces.wire import StrictModel, WireModel


class TokenizePromptRequest(StrictModel):
    model: StrictStr | None = None
    prompt: StrictStr
    #: As ``/v1/completions`` encodes a text prompt (BOS where the model wants one).
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(StrictModel):
    """The messages form: rendered exactly as a chat request with the same
    fields would be (``tool_choice`` and ``parallel_tool_calls`` are
    extensions, for prompts that force a tool call)."""

    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    #: Special tokens on top of what the template writes: only ``false``.
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False


class TokenizeReply(WireModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    #: Extension (issue K): how many leading ids were an assistant message's own.
    reused_prompt_tokens: int | None = None


class DetokenizeRequest(StrictModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeReply(WireModel):
    prompt: str


class TokenizerInfo(WireModel):
    """The tokenizer's configuration (``tokenizer_config.json``'s keys) with
    its class and chat template."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    #: Extension (issue K): whether re-rendering keeps the earlier prompt as
    #: a prefix when a ``user`` message or a ``tool`` result follows an
    #: assistant turn that reasoned (None: the template cannot render it).
    prefix_preserving: dict[str, bool | None] | None = None
