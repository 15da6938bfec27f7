"""The ASGI application: lifespan (load the model, run the pipeline) and
HTTP dispatch. Each route belongs to a surface, which reads the request's
API key and renders its errors; this layer speaks no API's dialect."""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import anyio

from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.protocol.errors import ApiError, AuthenticationFailed, InternalError, NotFound
from sluiceway.server import playground
from sluiceway.server.config import ServerConfig
from sluiceway.server.exchange import HttpCall, Submitter
from sluiceway.server.health import health
from sluiceway.server.http import (
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    send_error,
)
from sluiceway.server.parsing import choose_parsers
from sluiceway.server.routing import Router, merge_routes
from sluiceway.server.runtime import (
    LoadedModel,
    PipelineOptions,
    load_model,
    prefix_cache_bytes,
    run_pipeline,
)
from sluiceway.server.state import ServerState
from sluiceway.surfaces.anthropic import AnthropicSurface
from sluiceway.surfaces.base import (
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
            method: Route(spec, surface)
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
                    route = Route(spec.handler, surface, public=spec.public)
                    fallbacks.setdefault(path, {})[method] = route
                elif isinstance(spec, WhenHeaders):
                    slot = merged.setdefault(path, {})
                    route = Route(spec.handler, surface)
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


def route_table(
    state: ServerState, speaks: tuple[Surface, ...], page: Mapping[str, playground.Asset]
) -> Router[Route]:
    """Every route: the server's own (``/health``, the playground ``page``
    unless it is off) and each surface's. The server's own answer without an
    API key; their errors take the default surface's shape."""
    default = speaks[0]
    own: dict[str, Mapping[str, SurfaceHandler]] = {
        "/health": {"GET": functools.partial(health, state)}
    }
    if page:
        own |= playground.routes(page)
    public = {
        path: {method: Route(handler, default, public=True) for method, handler in methods.items()}
        for path, methods in own.items()
    }
    return Router(surfaces_table(speaks, public))


@dataclass(frozen=True, slots=True)
class Live:
    """What requests need once the server is up."""

    router: Router[Route]
    serving: Serving
    scheduler: Submitter

    def is_public(self, path: str) -> bool:
        """Whether every route on ``path`` answers without an API key (a
        wrong method there is then answered 405, not 401)."""
        methods = self.router.routes.get(path, {})
        return bool(methods) and all(route.public for route in methods.values())


class SluicewayApp:
    """An ASGI 3 application. Use :func:`create_app` to build one.

    ``speaks`` replaces the surfaces of :func:`surfaces` (tests add one).
    """

    def __init__(self, config: ServerConfig, speaks: tuple[Surface, ...] | None = None) -> None:
        self.config = config
        self.surfaces = surfaces(config) if speaks is None else speaks
        #: The playground's files, read once (none with ``--no-playground``).
        self.page = playground.load_assets() if config.playground else {}
        #: Set once the model is loaded and the pipeline runs.
        self.live: Live | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    # --- lifespan -----------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        try:
            model = await load_model(self.config)
        except Exception as error:
            logger.exception("start-up failed")
            await send({"type": "lifespan.startup.failed", "message": str(error)})
            return
        async with anyio.create_task_group() as group:
            handle = await group.start(
                functools.partial(
                    run_pipeline,
                    model,
                    self._scheduler_config(model),
                    PipelineOptions(processed_logprobs=self.config.logprobs_mode == "processed"),
                )
            )
            self._ready(model, handle)
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            group.cancel_scope.cancel()
        await model.thread.run(model.engine.close)
        model.thread.close()
        await send({"type": "lifespan.shutdown.complete"})

    def _scheduler_config(self, model: LoadedModel) -> SchedulerConfig:
        return SchedulerConfig(
            eos_ids=model.tokenizer.eos_ids,
            max_num_seqs=self.config.max_num_seqs,
            max_queued_requests=self.config.max_queued_requests,
            prefill_chunk_tokens=self.config.prefill_chunk_tokens,
            prefix_cache_bytes=prefix_cache_bytes(self.config, model.engine),
        )

    def _ready(self, model: LoadedModel, handle: SchedulerHandle) -> None:
        state = ServerState(
            self.config, model, handle, choose_parsers(self.config, model.tokenizer)
        )
        self.live = Live(route_table(state, self.surfaces, self.page), state.serving(), handle)

    # --- http ---------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        surface = self.surfaces[0]
        try:
            live = self._live(scope)
            found, params = self._resolve(live, scope)
            route = found.pick(scope.get("headers", ()))
            surface = route.surface
            if not route.public:
                self._authenticate(surface, scope)
            call = HttpCall(
                scope,
                receive,
                tracking_send,
                live.scheduler,
                params,
                self.config.max_body_bytes,
                self.config.keepalive_seconds,
            )
            await route.handler(live.serving, call)
        except ClientDisconnected:
            return
        except ApiError as error:
            if not started:
                await send_error(send, error, surface.render_error(error))
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                failure = InternalError("the server failed to handle this request")
                await send_error(send, failure, surface.render_error(failure))

    def _live(self, scope: Scope) -> Live:
        if self.live is None:
            raise NotFound("the server is still starting")
        return self.live

    def _resolve(self, live: Live, scope: Scope) -> tuple[Route, Mapping[str, str]]:
        """The route, or the error of a request that has none (rendered by
        the default surface); without a route, the default surface's
        credentials are checked first, so a keyless client learns nothing."""
        try:
            return live.router.resolve(scope["method"], scope["path"])
        except ApiError:
            if not live.is_public(scope["path"]):
                self._authenticate(self.surfaces[0], scope)
            raise

    def _authenticate(self, surface: Surface, scope: Scope) -> None:
        key = self.config.api_key
        if not key:
            return
        presented = surface.credentials(scope.get("headers", ()))
        if presented is None or not hmac.compare_digest(presented, key):
            raise AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")


def create_app(config: ServerConfig | None = None) -> SluicewayApp:
    """The app factory: ``hypercorn "sluiceway.server:create_app()"`` reads its
    configuration from ``SLUICEWAY_*`` environment variables."""
    return SluicewayApp(config or ServerConfig.from_env())
