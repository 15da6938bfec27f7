"""What the generation endpoints share once a request is validated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sluiceway.actors.emitters.completions import Echo
from sluiceway.actors.output import OutputConfig
from sluiceway.parsers.detokenizer import IncrementalDetokenizer, TokenTable
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.protocol.chat import SamplingFields
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.server.state import ServerState


def output_config(
    state: ServerState,
    generation: GenerationRequest,
    request: SamplingFields,
    *,
    make_pipeline: Callable[[], ChoicePipeline],
    index_offset: int = 0,
) -> OutputConfig:
    return OutputConfig(
        request_id=generation.request_id,
        n=generation.n,
        prompt_ids=generation.prompt_ids,
        index_offset=index_offset,
        table=state.model.tokenizer.table,
        make_pipeline=make_pipeline,
        logprobs=generation.logprobs.per_token,
        tokens_as_ids=bool(
            state.config.return_tokens_as_token_ids or request.return_tokens_as_token_ids
        ),
        include_stop_token_text=request.include_stop_str_in_output,
    )


def echo_of(table: TokenTable, prompt_ids: tuple[int, ...], tokens_as_ids: bool) -> Echo:
    """The prompt as ``echo`` repeats it: special tokens included, every
    token's offset where its first character lands (or the next one's)."""
    detokenizer = IncrementalDetokenizer(replace(table, hidden=frozenset()))
    pieces: list[str] = []
    offsets: list[int] = []
    length = 0
    waiting: list[int] = []
    for token_id in prompt_ids:
        text = detokenizer.feed(token_id)
        waiting.append(len(offsets))
        offsets.append(length)
        if text:
            for position in waiting:
                offsets[position] = length
            waiting.clear()
            pieces.append(text)
            length += len(text)
    tail = detokenizer.finish()
    if tail:
        pieces.append(tail)
        length += len(tail)
    for position in waiting:
        offsets[position] = length - len(tail)
    strings = tuple(f"token_id:{t}" if tokens_as_ids else table.display(t) for t in prompt_ids)
    return Echo(text="".join(pieces), tokens=strings, offsets=tuple(offsets))
