"""What the OpenAI encoders share: the spelling of finish reasons, tool-call
ids and logprob tokens, usage and logprob conversion, the error frame.

The streaming exchange drives an encoder in the request's own task
(``sluiceway.server.exchange``): framing is a function call per event, not
another task and channel hop.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from pydantic_core import to_json

from sluiceway.protocol.messages import ChoiceDelta, FinishCause, LogprobEntry, Usage
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces.openai.wire import (
    CompletionTokensDetails,
    PromptTokensDetails,
    TokenLogprobWire,
    TopLogprobWire,
    UsageWire,
)
from sluiceway.surfaces.sse import comment

DONE = b"data: [DONE]\n\n"
KEEPALIVE = comment("keepalive")


def finish_reason(delta: ChoiceDelta) -> str | None:
    """OpenAI's ``finish_reason`` for a delta (None until the choice's last).

    ``length`` when ``max_tokens`` ran out; otherwise ``tool_calls`` when the
    choice called tools, else ``stop``. A choice the scheduler cut off
    (``CANCELLED``: the server shutting down mid-stream; a client that went
    away sees nothing) reads ``stop``: OpenAI's enum has no value for it, and
    clients validate against that enum.
    """
    cause = delta.finish
    if cause is None:
        return None
    if cause is FinishCause.MAX_TOKENS:
        return "length"
    return "tool_calls" if delta.called_tools else "stop"


def tool_call_id() -> str:
    """A new tool call's id, minted where the call's name first goes out."""
    return f"call_{secrets.token_hex(12)}"


def token_text(token: str, token_id: int, as_ids: bool) -> str:
    """A logprob entry's ``token``: its text, or ``token_id:N`` (the vLLM
    extension ``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_ids else token


def ids_json(ids: tuple[int, ...]) -> bytes:
    """Token ids as the inside of a JSON array (a template's ``token_ids``)."""
    return ",".join(map(str, ids)).encode()


def usage_wire(usage: Usage) -> UsageWire:
    return UsageWire(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )


def entry_wire(entry: LogprobEntry, as_ids: bool) -> TokenLogprobWire:
    wire = TokenLogprobWire(
        token=token_text(entry.token, entry.token_id, as_ids),
        logprob=entry.logprob,
        bytes=list(entry.bytes),
        top_logprobs=[
            TopLogprobWire(
                token=token_text(top.token, top.token_id, as_ids),
                logprob=top.logprob,
                bytes=list(top.bytes),
            )
            for top in entry.top_logprobs
        ],
    )
    if entry.requested:
        wire.token_id_logprobs = {str(t): v for t, v in entry.requested}
    return wire


#: :func:`shown_tokens`' memo in each vocabulary, by spelling (ids or text).
_SHOWN = {False: "openai.shown_tokens:text", True: "openai.shown_tokens:ids"}


def shown_tokens(vocabulary: TokenTable, as_ids: bool) -> dict[int, tuple[str, list[int]]]:
    """What a logprob entry shows of each id it has met -- its ``token``
    (:func:`token_text`) and its ``bytes`` -- made once per id, vocabulary and
    spelling (:func:`show_token` on a miss) in a memo that lives as long as
    the vocabulary (:meth:`TokenTable.memo`) and that every stream and both
    template encoders share: top-k alternatives repeat across requests far
    more than within one."""
    return vocabulary.memo(_SHOWN[as_ids])


def show_token(vocabulary: TokenTable, as_ids: bool, token_id: int) -> tuple[str, list[int]]:
    """Make what :func:`shown_tokens` has not got yet for ``token_id``."""
    token, raw = vocabulary.entry_parts(token_id)
    made = shown_tokens(vocabulary, as_ids)[token_id] = (
        token_text(token, token_id, as_ids),
        list(raw),
    )
    return made


class EntryJson:
    """Logprob entries as JSON text: what ``entries_wire`` would dump to.

    A streamed token with top-5 logprobs is six entries; building and dumping
    six pydantic models per token cost more than the rest of its frame
    (``bench/pertoken-results.md``). Here each entry is a plain dict, and the
    frame's entries go to pydantic's own serialiser in one call (the same
    number spelling as the models', and non-finite numbers as ``null``).
    What an entry says about its token -- the ``token`` text and the
    ``bytes`` -- depends only on the id (:func:`shown_tokens`).
    """

    __slots__ = ("_as_ids",)

    def __init__(self, as_ids: bool) -> None:
        self._as_ids = as_ids

    def _entry(self, entry: LogprobEntry) -> dict[str, object]:
        vocabulary, as_ids = entry.vocabulary, self._as_ids
        shown = shown_tokens(vocabulary, as_ids)
        token, raw = shown.get(entry.token_id) or show_token(vocabulary, as_ids, entry.token_id)
        tops = []
        for token_id, logprob in entry.top:
            text, data = shown.get(token_id) or show_token(vocabulary, as_ids, token_id)
            tops.append({"token": text, "logprob": logprob, "bytes": data})
        found: dict[str, object] = {
            "token": token,
            "logprob": entry.logprob,
            "bytes": raw,
            "top_logprobs": tops,
        }
        if entry.requested:
            found["token_id_logprobs"] = {str(t): v for t, v in entry.requested}
        return found

    def array(self, entries: Iterable[LogprobEntry]) -> bytes:
        return to_json([self._entry(entry) for entry in entries], inf_nan_mode="null")


def entries_wire(entries: Iterable[LogprobEntry], as_ids: bool) -> list[TokenLogprobWire]:
    return [entry_wire(entry, as_ids) for entry in entries]


def prompt_entries_wire(
    entries: Iterable[LogprobEntry | None], top: int, as_ids: bool
) -> list[TokenLogprobWire | None]:
    """Prompt entries (the first is null), each cut to its ``top`` alternatives."""
    wires: list[TokenLogprobWire | None] = []
    for entry in entries:
        if entry is None:
            wires.append(None)
            continue
        wire = entry_wire(entry, as_ids)
        wire.top_logprobs = wire.top_logprobs[:top]
        wires.append(wire)
    return wires
