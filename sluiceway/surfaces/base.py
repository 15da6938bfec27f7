"""The seam between the HTTP edge (``sluiceway.server``) and the API surfaces.

A surface is a folder under ``sluiceway/surfaces/`` that implements
:class:`Surface`: its routes (path -> method -> handler), its error renderer
and where it reads the API key from. The edge resolves a route, checks the
key the route's surface presents, and calls the handler with the read-only
:class:`Serving` context and a :class:`Call` -- the one HTTP exchange, through
which the handler reads its body and answers: ``send_json`` for a whole
body, ``stream(jobs, encoder)`` for server-sent events, ``collect(jobs, add)``
for a reply built from the same events. Errors a handler raises
(:class:`~sluiceway.protocol.errors.ApiError`) are rendered by the route's
surface, before or instead of any reply.

Surfaces import downward only (actors, parsers, engines, protocol); the edge
imports the surfaces, never the other way round.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from sluiceway.actors.constraints import ConstraintCompiler
from sluiceway.actors.output import OutputConfig
from sluiceway.engines.base import EngineInfo
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.registry import ParserChoice
from sluiceway.protocol.errors import (
    ApiError,
    DeadlineExceeded,
    InternalError,
    ServiceUnavailable,
)
from sluiceway.protocol.messages import EmitterEvent, Failed, FailureCause, GenerationRequest

#: HTTP headers as ASGI carries them: lower-case names, raw values.
Headers = Sequence[tuple[bytes, bytes]]

JSON_HEADERS: Headers = ((b"content-type", b"application/json"),)


@dataclass(frozen=True, slots=True)
class Job:
    """One generation request of a reply and how its output is produced (a
    chat reply has one; a legacy completion has one per prompt)."""

    request: GenerationRequest
    output: OutputConfig


class StreamEncoder(Protocol):
    """A sans-IO encoder of one reply's events into SSE frames (bytes)."""

    def start(self) -> bytes:
        """What goes out first, once the reply is accepted (may be empty)."""
        ...

    def encode(self, event: EmitterEvent) -> bytes: ...

    def keepalive(self) -> bytes:
        """A frame that keeps the stream alive while nothing flows (an SSE
        comment, or a ``ping`` event where the surface defines one)."""
        ...


class Accumulator(Protocol):
    """Builds one whole (non-streamed) reply from a reply's events."""

    @property
    def failure(self) -> str | None:
        """Why the generation failed, if it did."""
        ...

    def add(self, event: EmitterEvent) -> None: ...

    def to_json(self) -> str:
        """The reply's body, once every job has completed."""
        ...


class Call(Protocol):
    """One HTTP exchange, as a surface's handler sees it."""

    @property
    def params(self) -> Mapping[str, str]:
        """The path parameters of the route (``/v1/models/{model}``)."""
        ...

    @property
    def method(self) -> str:
        """``GET``, ``POST``, ... (a ``HEAD`` request's replies go out without a body)."""
        ...

    @property
    def headers(self) -> Headers: ...

    async def body(self) -> bytes:
        """The whole request body (bounded by ``--max-body-bytes``: 413 past it)."""
        ...

    async def send_json(self, text: str, status: int = 200) -> None: ...

    async def send_bytes(self, status: int, body: bytes, headers: Headers) -> None:
        """A whole reply of any content type (the headers name it)."""
        ...

    async def stream(self, jobs: Sequence[Job], encoder: StreamEncoder) -> None:
        """Submit the jobs and stream the encoder's frames until the reply
        ends or the client goes away (which cancels the jobs)."""
        ...

    async def collect(self, jobs: Sequence[Job], collect: Callable[[EmitterEvent], None]) -> bool:
        """Submit the jobs and hand every event to ``collect``; False when
        the client went away first (then there is nobody to answer)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """What every surface's handlers know of the server: read-only after start-up."""

    model_name: str
    #: When the model was loaded (Unix seconds).
    created: int
    engine: EngineInfo
    tokenizer: ModelTokenizer
    parsers: ParserChoice
    max_num_seqs: int
    max_top_logprobs: int
    stop_in_reasoning: bool
    #: Chat template variables every request starts from (``--default-chat-template-kwargs``).
    default_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Whether the chat template is prefix-preserving for a user message and
    #: a tool result after an assistant turn (probed at start-up; issue K).
    prefix_preserving: Mapping[str, bool | None] = field(default_factory=dict)
    #: Compiles the constraints of structured output (refuses them all
    #: where the model's tokenizer has no grammar engine).
    constraints: ConstraintCompiler = field(default_factory=lambda: ConstraintCompiler(None))

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_context(self) -> int:
        return self.engine.max_context


SurfaceHandler = Callable[[Serving, Call], Awaitable[None]]

#: A test on a request's headers (``anthropic-version`` present, say).
HeaderTest = Callable[[Headers], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class WhenHeaders:
    """A route on a path and method that another surface serves too: this
    handler takes the requests whose headers ``test`` picks, the other
    surface's the rest (and this one all of them where no other serves it).
    ``GET /v1/models`` answers in Anthropic's shape to a request that carries
    ``anthropic-version``, in OpenAI's to any other."""

    handler: SurfaceHandler
    test: HeaderTest


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallback:
    """A route that answers only where no other surface routes its path (a
    client's probe of ``HEAD /``, which a page at ``/`` answers when there
    is one); ``public``: it answers without an API key."""

    handler: SurfaceHandler
    public: bool = False


#: What a surface routes a path and method to.
RouteSpec = SurfaceHandler | WhenHeaders | Fallback


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorResponse:
    """An error as a surface renders it; the edge adds the neutral headers
    (``allow``, ``retry-after``)."""

    status: int
    body: bytes
    headers: Headers = JSON_HEADERS


class Surface(Protocol):
    """An API surface: its routes, its error renderer, its credentials."""

    @property
    def name(self) -> str: ...

    def routes(self) -> Mapping[str, Mapping[str, RouteSpec]]:
        """Path -> method -> handler; paths may hold ``{name}`` segments. A
        handler wrapped in :class:`WhenHeaders` or :class:`Fallback` shares
        its path with other surfaces."""
        ...

    def render_error(self, error: ApiError) -> ErrorResponse: ...

    def credentials(self, headers: Headers) -> str | None:
        """The API key the request presents, the surface's way (None: none)."""
        ...


def failure_error(failure: Failed) -> ApiError:
    """The error a whole reply ends in when its generation failed: 503 when
    the server shut down under it (retry elsewhere), 504 past the request's
    time limit, else the server's 500."""
    if failure.cause is FailureCause.SHUTDOWN:
        return ServiceUnavailable(failure.message)
    if failure.cause is FailureCause.DEADLINE:
        return DeadlineExceeded(failure.message)
    return InternalError(failure.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class Operation:
    """What ``/openapi.json`` says of one route of a surface: its wire models
    (pydantic), from which the document's schemas are generated."""

    summary: str
    #: The JSON body the route takes, if any.
    request: type[BaseModel] | None = None
    #: The JSON body of its reply.
    response: type[BaseModel] | None = None
    #: The payload of each server-sent event, when the route streams.
    event: type[BaseModel] | None = None
    #: The body of its error replies.
    error: type[BaseModel] | None = None


@runtime_checkable
class Documented(Protocol):
    """A surface that describes its routes for ``/openapi.json`` (optional:
    an undocumented surface's routes are listed without schemas)."""

    def operations(self) -> Mapping[str, Mapping[str, Operation]]:
        """Path -> method -> operation, for the paths of ``routes()``."""
        ...


async def send_whole(call: Call, jobs: Sequence[Job], accumulator: Accumulator) -> None:
    """Run the jobs to the end and send the accumulated reply as one body
    (nothing, if the client went away; a failure is rendered by the route's
    surface, with the status :func:`failure_error` gives it)."""
    failures: list[Failed] = []

    def add(event: EmitterEvent) -> None:
        if type(event) is Failed:
            failures.append(event)
        accumulator.add(event)

    if not await call.collect(jobs, add):
        return  # the client is gone; nobody to answer
    if failures:
        raise failure_error(failures[0])
    if accumulator.failure is not None:
        raise InternalError(accumulator.failure)
    await call.send_json(accumulator.to_json())


def bearer_token(headers: Headers) -> str | None:
    """The key an ``Authorization: Bearer`` header presents (None: none)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
