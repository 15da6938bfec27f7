"""The ASGI application: lifespan (load the model in the background, run the
pipeline) and HTTP dispatch. Each route belongs to a surface, which reads
the request's API key and renders its errors; this layer speaks no API's
dialect."""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import cast

import anyio

from sluiceway.actors.scheduler import SchedulerConfig
from sluiceway.actors.seam import EngineHandle
from sluiceway.protocol.errors import (
    ApiError,
    AuthenticationFailed,
    InternalError,
    ServiceUnavailable,
)
from sluiceway.server import introspection, openapi, playground
from sluiceway.server.config import ServerConfig
from sluiceway.server.cors import Cors
from sluiceway.server.exchange import HttpCall, Submitter, Tracking
from sluiceway.server.http import (
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    send_bytes,
    send_error,
)
from sluiceway.server.lifecycle import Lifecycle
from sluiceway.server.metrics import Metrics
from sluiceway.server.parsing import choose_parsers
from sluiceway.server.record import RequestRecord, request_id
from sluiceway.server.routing import Router, merge_routes
from sluiceway.server.runtime import (
    LoadedModel,
    PipelineOptions,
    load_model,
    prefix_cache_bytes,
    run_engine,
)
from sluiceway.server.state import ServerState
from sluiceway.server.supervision import Supervisor
from sluiceway.surfaces.anthropic import AnthropicSurface
from sluiceway.surfaces.base import (
    Call,
    Fallback,
    Headers,
    HeaderTest,
    Serving,
    Surface,
    SurfaceHandler,
    WhenHeaders,
)
from sluiceway.surfaces.openai import OpenAIOptions, OpenAISurface
from sluiceway.surfaces.responses import ResponsesSurface
from sluiceway.surfaces.tokens import TokensSurface

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("sluiceway.access")


def surfaces(config: ServerConfig) -> tuple[Surface, ...]:
    """The API surfaces the server speaks, one line each. The first renders
    the errors of requests that match no route (404, 405)."""
    return (
        OpenAISurface(
            OpenAIOptions(
                reasoning_field=config.reasoning_field,
                return_tokens_as_token_ids=config.return_tokens_as_token_ids,
            )
        ),
        TokensSurface(),
        AnthropicSurface(),
        ResponsesSurface(),
    )


@dataclass(frozen=True, slots=True)
class Route:
    """A handler and the surface that owns it."""

    handler: SurfaceHandler
    surface: Surface
    #: Answers without an API key.
    public: bool = False
    #: Answers while the model loads (the handler then gets no serving context).
    early: bool = False
    #: The path pattern, for metrics and logs.
    path: str = ""
    #: Other surfaces' routes on the same path and method, each taking the
    #: requests its header test picks (:class:`WhenHeaders`); tried in order.
    alternatives: tuple[tuple[HeaderTest, Route], ...] = ()

    def pick(self, headers: Headers) -> Route:
        """The route that serves a request with these headers."""
        for test, route in self.alternatives:
            if test(headers):
                return route
        return self


RouteTable = dict[str, dict[str, Route]]


def surface_routes(surface: Surface) -> RouteTable:
    """The routes a surface claims alone (not those it shares with others)."""
    table: RouteTable = {}
    for path, methods in surface.routes().items():
        own = {
            method: Route(spec, surface, path=path)
            for method, spec in methods.items()
            if not isinstance(spec, WhenHeaders | Fallback)
        }
        if own:
            table[path] = own
    return table


def shared_routes(table: RouteTable, speaks: tuple[Surface, ...]) -> RouteTable:
    """``table`` with the routes the surfaces share added: a
    :class:`WhenHeaders` route goes before the path's own route, a
    :class:`Fallback` where no route has the path."""
    merged = {path: dict(methods) for path, methods in table.items()}
    fallbacks: RouteTable = {}
    for surface in speaks:
        for path, methods in surface.routes().items():
            for method, spec in methods.items():
                if isinstance(spec, Fallback):
                    route = Route(spec.handler, surface, public=spec.public, path=path)
                    fallbacks.setdefault(path, {})[method] = route
                elif isinstance(spec, WhenHeaders):
                    slot = merged.setdefault(path, {})
                    route = Route(spec.handler, surface, path=path)
                    default = slot.get(method)
                    slot[method] = (
                        route
                        if default is None
                        else replace(
                            default, alternatives=(*default.alternatives, (spec.test, route))
                        )
                    )
    for path, routes in fallbacks.items():
        merged.setdefault(path, routes)
    return merged


def surfaces_table(speaks: tuple[Surface, ...], own: RouteTable | None = None) -> RouteTable:
    """The server's own routes and every surface's, shared ones included."""
    claimed = merge_routes(own or {}, *(surface_routes(surface) for surface in speaks))
    return shared_routes(claimed, speaks)


def own_routes(
    lifecycle: Lifecycle, speaks: tuple[Surface, ...], page: Mapping[str, playground.Asset]
) -> dict[str, dict[str, Route]]:
    """The server's own routes; their errors take the default surface's shape.
    All answer while the model loads; all but the discovery routes (which name
    the model's path) and the load report answer without an API key."""
    default = speaks[0]

    def own(handler: SurfaceHandler, path: str, *, public: bool = True) -> Route:
        return Route(handler, default, public=public, early=True, path=path)

    def about(handler: Callable[[Lifecycle, Serving, Call], Awaitable[None]]) -> SurfaceHandler:
        return functools.partial(handler, lifecycle)

    table = {
        "/health": {"GET": own(about(introspection.health), "/health")},
        "/ready": {"GET": own(about(introspection.ready), "/ready")},
        "/metrics": {"GET": own(about(introspection.metrics), "/metrics")},
        "/version": {"GET": own(about(introspection.version), "/version")},
        "/openapi.json": {
            "GET": own(functools.partial(openapi.serve, openapi.document(speaks)), "/openapi.json")
        },
        "/server_info": {
            "GET": own(about(introspection.server_info), "/server_info", public=False)
        },
        "/model_info": {"GET": own(about(introspection.model_info), "/model_info", public=False)},
        "/v1/loads": {"GET": own(about(introspection.loads), "/v1/loads", public=False)},
    }
    for path, methods in (playground.routes(page) if page else {}).items():
        table[path] = {
            method: Route(handler, default, public=True, path=path)
            for method, handler in methods.items()
        }
    return table


def route_table(
    lifecycle: Lifecycle, speaks: tuple[Surface, ...], page: Mapping[str, playground.Asset]
) -> Router[Route]:
    """Every route: the server's own (``/health``, ``/metrics``, the
    playground ``page`` unless it is off, ...) and each surface's."""
    own = own_routes(lifecycle, speaks, page)
    return Router(surfaces_table(speaks, own))


@dataclass(frozen=True, slots=True)
class Live:
    """What requests need once the model is loaded."""

    router: Router[Route]
    serving: Serving
    scheduler: Submitter

    def is_public(self, path: str) -> bool:
        """Whether every route on ``path`` answers without an API key (a
        wrong method there is then answered 405, not 401)."""
        return _is_public(self.router, path)


def _is_public(router: Router[Route], path: str) -> bool:
    methods = router.routes.get(path, {})
    return bool(methods) and all(route.public for route in methods.values())


class SluicewayApp:
    """An ASGI 3 application. Use :func:`create_app` to build one.

    ``speaks`` replaces the surfaces of :func:`surfaces` (tests add one).
    """

    def __init__(self, config: ServerConfig, speaks: tuple[Surface, ...] | None = None) -> None:
        self.config = config
        self.surfaces = surfaces(config) if speaks is None else speaks
        self.api_key = config.key()
        self.cors = Cors(config.origins())
        self.supervisor = Supervisor(
            request_timeout=config.request_timeout or None,
            stall_timeout=config.stall_timeout or None,
        )
        self.metrics = Metrics(config.model_name)
        self.lifecycle = Lifecycle(config, self.metrics, self.supervisor)
        self.metrics.watch(self.lifecycle.load, self.lifecycle.prefix_cache)
        #: The playground's files, read once (none with ``--no-playground``).
        self.page = playground.load_assets() if config.playground else {}
        self.router = route_table(self.lifecycle, self.surfaces, self.page)
        #: Set once the model is loaded and the pipeline runs.
        self.live: Live | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def drain(self) -> None:
        """Stop admitting and let running requests finish (see :mod:`lifecycle`)."""
        await self.lifecycle.drain()

    # --- lifespan -----------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        self.lifecycle.fatal = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(self._serve_model)
            group.start_soon(self.supervisor.watch)
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            group.cancel_scope.cancel()
        model = self.lifecycle.model
        if model is not None:
            await model.thread.run(model.engine.close)
            model.thread.close()
        await send({"type": "lifespan.shutdown.complete"})

    async def _serve_model(self) -> None:
        """Load the model, then run the pipeline until the server stops."""
        try:
            model = await load_model(self.config)
        except Exception:
            logger.exception("loading the model failed; the server cannot serve")
            self.lifecycle.failed()
            return
        async with anyio.create_task_group() as group:
            handle = await group.start(
                functools.partial(
                    run_engine,
                    model,
                    self._scheduler_config(model),
                    PipelineOptions(processed_logprobs=self.config.logprobs_mode == "processed"),
                )
            )
            self._ready(model, handle)

    def _scheduler_config(self, model: LoadedModel) -> SchedulerConfig:
        return SchedulerConfig(
            eos_ids=model.tokenizer.eos_ids,
            max_num_seqs=self.config.max_num_seqs,
            max_queued_requests=self.config.max_queued_requests,
            prefill_chunk_tokens=self.config.prefill_chunk_tokens,
            stall_timeout=self.config.stall_timeout or None,
            on_admitted=self.metrics.queue_time.observe,
            prefix_cache_bytes=prefix_cache_bytes(self.config, model.engine),
            release_memory_after=self.config.release_memory_after or None,
        )

    def _ready(self, model: LoadedModel, handle: EngineHandle) -> None:
        state = ServerState(
            self.config, model, handle, choose_parsers(self.config, model.tokenizer)
        )
        self.live = Live(self.router, state.serving(), handle)
        self.lifecycle.loaded(model, handle)
        logger.info("ready to serve %s", self.config.model_name)

    # --- http ---------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: Headers = scope.get("headers", ())
        record = RequestRecord(
            request_id(headers),
            scope["method"],
            scope["path"],
            on_gap=self.metrics.inter_token.observe,
        )
        extra = [(b"x-request-id", record.request_id.encode()), *self.cors.reply_headers(headers)]

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            await self._dispatch(scope, receive, tracking_send, record)
        finally:
            self.metrics.finished(record)
            access_logger.info("%s", record.log_line())

    async def _dispatch(
        self, scope: Scope, receive: Receive, send: Send, record: RequestRecord
    ) -> None:
        preflight = self.cors.preflight(scope["method"], scope.get("headers", ()))
        if preflight is not None:
            await send_bytes(send, 204, b"", preflight)
            return
        surface = self.surfaces[0]
        try:
            live = self.live
            found, params = self._resolve(live.router if live else self.router, scope)
            route = found.pick(scope.get("headers", ()))
            surface = route.surface
            record.route, record.surface = route.path, surface.name
            if not route.public:
                self._authenticate(surface, scope)
            if live is None and not route.early:
                raise ServiceUnavailable("the server is loading its model; retry shortly")
            call = HttpCall(
                scope,
                receive,
                send,
                cast(Submitter, live.scheduler if live else None),
                params,
                self.config.max_body_bytes,
                self.config.keepalive_seconds,
                Tracking(self.supervisor, record, self.config.stream_interval),
            )
            await route.handler(cast(Serving, live.serving if live else None), call)
        except ClientDisconnected:
            record.status = record.status or 499
        except ApiError as error:
            if record.status is None:
                await send_error(send, error, surface.render_error(error))
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if record.status is None:
                failure = InternalError("the server failed to handle this request")
                await send_error(send, failure, surface.render_error(failure))

    def _resolve(self, router: Router[Route], scope: Scope) -> tuple[Route, Mapping[str, str]]:
        """The route, or the error of a request that has none (rendered by
        the default surface); without a route, the default surface's
        credentials are checked first, so a keyless client learns nothing."""
        try:
            return router.resolve(scope["method"], scope["path"])
        except ApiError:
            if not _is_public(router, scope["path"]):
                self._authenticate(self.surfaces[0], scope)
            raise

    def _authenticate(self, surface: Surface, scope: Scope) -> None:
        key = self.api_key
        if not key:
            return
        presented = surface.credentials(scope.get("headers", ()))
        # Compared as bytes: compare_digest refuses a str with non-ASCII in it.
        if presented is None or not hmac.compare_digest(
            presented.encode("utf-8", "surrogatepass"), key.encode("utf-8")
        ):
            raise AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")


def create_app(config: ServerConfig | None = None) -> SluicewayApp:
    """The app factory: ``hypercorn "sluiceway.server:create_app()"`` reads its
    configuration from ``SLUICEWAY_*`` environment variables."""
    return SluicewayApp(config or ServerConfig.from_env())
