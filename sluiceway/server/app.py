"""The ASGI application: lifespan (load the model, run the pipeline) and
HTTP dispatch with error mapping. Only this layer turns typed client errors
into OpenAI error bodies."""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Awaitable, Callable

import anyio

from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.protocol.errors import AuthenticationFailed, ClientError, NotFound
from sluiceway.server.config import ServerConfig
from sluiceway.server.handlers import chat, completions, info
from sluiceway.server.http import (
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    send_error,
    send_server_error,
)
from sluiceway.server.parsing import choose_parsers
from sluiceway.server.routing import Handler, Router
from sluiceway.server.runtime import (
    LoadedModel,
    PipelineOptions,
    load_model,
    prefix_cache_bytes,
    run_pipeline,
)
from sluiceway.server.state import ServerState

logger = logging.getLogger(__name__)

StateHandler = Callable[[ServerState, Scope, Receive, Send], Awaitable[None]]

#: Routes that answer without an API key.
PUBLIC_PATHS = frozenset({"/health"})


class SluicewayApp:
    """An ASGI 3 application. Use :func:`create_app` to build one."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state: ServerState | None = None
        self._router: Router | None = None

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
        self.state = state

        def bind(handler: StateHandler) -> Handler:
            return functools.partial(handler, state)

        self._router = Router(
            {
                "/health": {"GET": bind(info.health)},
                "/v1/models": {"GET": bind(info.models)},
                "/v1/models/{model}": {"GET": bind(info.model)},
                "/v1/chat/completions": {"POST": bind(chat.handle)},
                "/v1/completions": {"POST": bind(completions.handle)},
            }
        )

    # --- http ---------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if self._router is None:
                raise NotFound("the server is still starting")
            handler = self._resolve(scope)
            await handler(scope, receive, tracking_send)
        except ClientDisconnected:
            return
        except ClientError as error:
            if not started:
                await send_error(send, error)
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_server_error(send, "the server failed to handle this request")

    def _resolve(self, scope: Scope) -> Handler:
        assert self._router is not None
        self._authenticate(scope, scope["path"])
        return self._router.resolve(scope["method"], scope["path"])

    def _authenticate(self, scope: Scope, path: str) -> None:
        key = self.config.api_key
        if not key or path in PUBLIC_PATHS:
            return
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), key):
                    return
        raise AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")


def create_app(config: ServerConfig | None = None) -> SluicewayApp:
    """The app factory: ``hypercorn "sluiceway.server:create_app()"`` reads its
    configuration from ``SLUICEWAY_*`` environment variables."""
    return SluicewayApp(config or ServerConfig.from_env())
