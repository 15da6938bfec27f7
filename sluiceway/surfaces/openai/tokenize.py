"""``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's
shapes). The messages form of ``/tokenize`` renders through the one
conversation renderer, so its ``tokens`` are the ``prompt_token_ids`` a chat
request with the same messages gets. Tokenizer work runs in a worker thread.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio

from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces import validation
from sluiceway.surfaces.base import Call, Serving
from sluiceway.surfaces.conversation import (
    ConversationParams,
    RenderedPrompt,
    StopOptions,
    render_conversation,
)
from sluiceway.surfaces.openai.chat import conversation_of
from sluiceway.surfaces.openai.tokenize_wire import (
    DetokenizeReply,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeReply,
    TokenizerInfo,
)
from sluiceway.surfaces.structured import calls_by_grammar


def _check_model(serving: Serving, model: str | None) -> None:
    if model is not None:
        validation.check_model(model, serving.model_name)


def _chat_prompt(serving: Serving, request: TokenizeChatRequest) -> RenderedPrompt:
    if request.continue_final_message and request.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if request.add_special_tokens:
        raise InvalidRequest(
            "add_special_tokens is not supported with messages: the chat template "
            "writes the special tokens",
            param="add_special_tokens",
        )
    conversation = replace(
        conversation_of(request),
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
    )
    # The prompt as chat would render it: where a grammar holds the tool
    # calls, no forced call prefix is written into it.
    by_grammar = calls_by_grammar(serving, conversation, None, ConversationParams())
    return render_conversation(serving, conversation, StopOptions(), tools_by_grammar=by_grammar)


def _tokenize(serving: Serving, payload: Any) -> TokenizeReply:
    """Blocking (template rendering, tokenizing): run it in a worker thread."""
    tokenizer = serving.tokenizer
    request: TokenizeChatRequest | TokenizePromptRequest
    if isinstance(payload, dict) and "messages" in payload:
        request = validation.parse_request(TokenizeChatRequest, payload)
        _check_model(serving, request.model)
        prompt = _chat_prompt(serving, request)
        ids, reused = prompt.ids, prompt.reused
    else:
        request = validation.parse_request(TokenizePromptRequest, payload)
        _check_model(serving, request.model)
        encode = tokenizer.encode_prompt if request.add_special_tokens else tokenizer.encode
        ids, reused = tuple(encode(request.prompt)), None
    reply = TokenizeReply(count=len(ids), max_model_len=serving.max_context, tokens=list(ids))
    if reused is not None:
        reply.reused_prompt_tokens = reused
    if request.return_token_strs:
        reply.token_strs = tokenizer.token_strings(ids)
    return reply


async def tokenize(serving: Serving, call: Call) -> None:
    payload = validation.parse_json(await call.body())
    reply = await anyio.to_thread.run_sync(_tokenize, serving, payload)
    await call.send_json(reply.to_json())


def _decode(table: TokenTable, ids: tuple[int, ...]) -> str:
    """Every token's text, special tokens included (as vLLM's ``/detokenize``)."""
    return replace(table, hidden=frozenset()).decode(ids)


async def detokenize(serving: Serving, call: Call) -> None:
    request = validation.parse_request(DetokenizeRequest, validation.parse_json(await call.body()))
    _check_model(serving, request.model)
    ids = validation.checked_ids(request.tokens, serving.vocab_size, "tokens")
    text = await anyio.to_thread.run_sync(_decode, serving.tokenizer.table, ids)
    await call.send_json(DetokenizeReply(prompt=text).to_json())


async def tokenizer_info(serving: Serving, call: Call) -> None:
    config = await anyio.to_thread.run_sync(serving.tokenizer.config)
    info = TokenizerInfo.model_validate(config)
    if serving.prefix_preserving:
        info.prefix_preserving = dict(serving.prefix_preserving)
    await call.send_json(info.to_json())
