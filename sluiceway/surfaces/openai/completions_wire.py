"""Wire models of the legacy ``/v1/completions`` endpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from sluiceway.surfaces.openai.chat_wire import SamplingFields
from sluiceway.surfaces.openai.wire import TokenLogprobWire, UsageWire
from sluiceway.surfaces.wire import WireModel

Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    suffix: StrictStr | None = None
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None


class CompletionLogprobsWire(WireModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    #: Extension (``logprob_token_ids``): those ids' logprobs at each position.
    token_id_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoiceWire(WireModel):
    index: int
    text: str
    logprobs: CompletionLogprobsWire | None
    finish_reason: str | None
    #: Extension: the stop string or stop token id that ended the choice.
    matched_stop: str | int | None = None
    #: Extension (``prompt_logprobs``): the prompt tokens' entries, the first null.
    prompt_logprobs: list[TokenLogprobWire | None] | None = None
    #: Extension (``return_token_ids``): this choice's prompt ids (on its first
    #: chunk when streaming) and the generated ids this fragment carries.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoiceWire]
    usage: UsageWire | None = None
