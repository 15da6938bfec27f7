"""OpenAI wire models shared by chat and completions: errors, usage,
logprobs, the model list."""

from __future__ import annotations

from typing import Literal

from sluiceway.surfaces.wire import WireModel


class PromptTokensDetails(WireModel):
    cached_tokens: int = 0


class CompletionTokensDetails(WireModel):
    reasoning_tokens: int = 0


class UsageWire(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprobWire(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobWire(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobWire]
    #: Extension: logprobs of the ids the request named in ``logprob_token_ids``.
    token_id_logprobs: dict[str, float] | None = None


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    #: Extension: which engine serves the model, and its context length.
    engine: str | None = None
    max_model_len: int | None = None


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
