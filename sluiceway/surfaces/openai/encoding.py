"""What the OpenAI encoders share: the spelling of finish reasons, tool-call
ids and logprob tokens, usage and logprob conversion, the error frame.

The streaming exchange drives an encoder in the request's own task
(``sluiceway.server.exchange``): framing is a function call per event, not
another task and channel hop.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from sluiceway.protocol.messages import ChoiceDelta, FinishCause, LogprobEntry, Usage
from sluiceway.surfaces.openai.wire import (
    CompletionTokensDetails,
    PromptTokensDetails,
    TokenLogprobWire,
    TopLogprobWire,
    UsageWire,
)
from sluiceway.surfaces.sse import comment, json_string

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


#: ``EntryJson``'s pieces by (as ids, token id), with the token and bytes
#: they were made from. Shared by all streams: top-k alternatives repeat
#: across requests far more than within one.
_PIECES: dict[tuple[bool, int], tuple[str, tuple[int, ...], tuple[bytes, bytes]]] = {}
#: Beyond this many, the memo starts again (a few vocabularies' worth).
_PIECES_BOUND = 1 << 19


class EntryJson:
    """Logprob entries as JSON text, the bytes ``entries_wire`` would dump to.

    A streamed token with top-5 logprobs is six entries; building and dumping
    six pydantic models per token cost more than the rest of its frame
    (``bench/pertoken-results.md``). What an entry says about its token -- the
    ``token`` text and the ``bytes`` -- depends only on the id, so those
    pieces are made once per id (``_PIECES``) and only the numbers are
    written per entry.
    """

    __slots__ = ("_as_ids",)

    def __init__(self, as_ids: bool) -> None:
        self._as_ids = as_ids

    def _piece(self, token: str, token_id: int, raw: tuple[int, ...]) -> tuple[bytes, bytes]:
        key = (self._as_ids, token_id)
        found = _PIECES.get(key)
        # The same id may stand for other text in another vocabulary; the
        # comparisons are identity checks when the entry came from the memo
        # of ``TokenTable.entry_parts``.
        if found is not None and found[0] == token and found[1] == raw:
            return found[2]
        text = json_string(token_text(token, token_id, self._as_ids))
        piece = (
            b'{"token":' + text + b',"logprob":',
            b',"bytes":[' + ",".join(map(str, raw)).encode() + b"]",
        )
        if len(_PIECES) >= _PIECES_BOUND:
            _PIECES.clear()
        _PIECES[key] = (token, raw, piece)
        return piece

    def entry(self, entry: LogprobEntry) -> bytes:
        head, raw = self._piece(entry.token, entry.token_id, entry.bytes)
        tops = []
        for top in entry.top_logprobs:
            top_head, top_raw = self._piece(top.token, top.token_id, top.bytes)
            tops.append(top_head + number_json(top.logprob) + top_raw + b"}")
        text = (
            head + number_json(entry.logprob) + raw + b',"top_logprobs":[' + b",".join(tops) + b"]"
        )
        if entry.requested:
            requested = (b'"%d":' % t + number_json(v) for t, v in entry.requested)
            text += b',"token_id_logprobs":{' + b",".join(requested) + b"}"
        return text + b"}"

    def array(self, entries: Iterable[LogprobEntry]) -> bytes:
        return b"[" + b",".join(self.entry(entry) for entry in entries) + b"]"


def number_json(value: float) -> bytes:
    """A logprob as JSON text."""
    # repr is the shortest text that reads back as the same double, as
    # pydantic's serialiser writes it (the exponent's spelling may differ);
    # like pydantic, a non-finite number is null (the reducer floors them).
    if value.__class__ is not float:  # a NumPy scalar's repr names its type
        value = float(value)
    # x - x is 0.0 for a finite x and NaN otherwise: cheaper than a call to
    # math.isfinite, at six numbers per token with top-5.
    return repr(value).encode() if value - value == 0.0 else b"null"


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
