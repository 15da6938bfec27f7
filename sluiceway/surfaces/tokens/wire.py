"""Wire models of ``POST /inference/v1/generate``, shaped as vLLM's tokens-in,
tokens-out endpoint (``GenerateRequest`` / ``GenerateResponse`` of its
``serving_tokens``), so clients written for it work unchanged."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from sluiceway.surfaces.structured import StructuredOutputs
from sluiceway.surfaces.wire import StrictModel, WireModel

Probability = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]


class StreamOptions(StrictModel):
    include_usage: StrictBool = False
    #: vLLM's per-chunk usage; not supported (only ``false`` is accepted).
    continuous_usage_stats: StrictBool | None = None


class SamplingParamsWire(StrictModel):
    """vLLM's ``SamplingParams``, the fields this server runs (plus three
    about detokenizing, accepted and without effect: this path has no text)."""

    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    seed: StrictInt | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    logprob_token_ids: list[StrictInt] | None = None
    #: vLLM's ``StructuredOutputsParams``: what every choice's ids must spell.
    structured_outputs: StructuredOutputs | None = None
    # Accepted for compatibility: they shape text, and this path returns none.
    detokenize: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None


class GenerateRequest(StrictModel):
    model: StrictStr | None = None
    #: The prompt, used as given: no chat template, no BOS added.
    token_ids: list[StrictInt]
    sampling_params: SamplingParamsWire = Field(default_factory=SamplingParamsWire)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    #: Echoed as the reply's ``id`` (the server keys the request by its own id).
    request_id: StrictStr | None = None
    # vLLM fields this server has nothing behind: accepted at their defaults only.
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    kv_transfer_params: dict[str, Any] | None = None
    features: dict[str, Any] | None = None


# --- replies ---------------------------------------------------------------


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


class ChoiceLogprobsWire(WireModel):
    content: list[TokenLogprobWire]


class PromptLogprobWire(WireModel):
    """vLLM's ``Logprob``: one id's logprob at one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str


#: Per prompt position (the first is null): id (as a JSON key) -> its logprob.
PromptLogprobs = list[dict[str, PromptLogprobWire] | None]


class PromptTokensDetailsWire(WireModel):
    cached_tokens: int = 0


class UsageWire(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: vLLM's ``UsageInfo`` field: the prompt tokens the prefix cache served.
    prompt_tokens_details: PromptTokensDetailsWire


class GenerateChoiceWire(WireModel):
    index: int
    token_ids: list[int]
    logprobs: ChoiceLogprobsWire | None
    finish_reason: str
    #: The stop string or stop token id that ended the choice (else null).
    matched_stop: str | int | None


class GenerateReply(WireModel):
    id: str
    #: vLLM's name for ``id``.
    request_id: str
    object: Literal["generate"] = "generate"
    created: int
    model: str
    choices: list[GenerateChoiceWire]
    usage: UsageWire
    prompt_logprobs: PromptLogprobs | None


class GenerateChunkChoiceWire(WireModel):
    index: int
    token_ids: list[int]
    logprobs: ChoiceLogprobsWire | None
    finish_reason: str | None
    matched_stop: str | int | None = None


class GenerateChunk(WireModel):
    id: str
    request_id: str
    object: Literal["generate.chunk"] = "generate.chunk"
    created: int
    model: str
    choices: list[GenerateChunkChoiceWire]
    usage: UsageWire | None = None
    prompt_logprobs: PromptLogprobs | None = None
