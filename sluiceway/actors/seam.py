"""The seam between the server and whatever schedules the engine.

Two kinds of engine sit under the output actors. Ours are scheduled here:
the scheduler, sampler and logprob reducer plan every step of a model runner
(``sluiceway.actors.scheduler.SchedulerHandle`` is their front). vLLM's
``AsyncLLM`` schedules itself (``sluiceway.actors.vllm_runner.VllmHandle``).
Both take the neutral :class:`GenerationRequest` and put, per request, the
same :data:`RequestOutput` messages in its outbox: token ids with their
logprob entries and finish causes, prompt scores, the cached-token count, a
failure. The server (handlers, exchange, lifecycle, metrics) holds an
:class:`EngineHandle` and never asks which one it is.
"""

from __future__ import annotations

import abc

from sluiceway.actors.prefix_cache import PrefixCacheStats
from sluiceway.protocol.errors import Overloaded, ServiceUnavailable
from sluiceway.protocol.messages import Backlog, GenerationRequest, Outbox, RequestOutput


class EngineHandle(abc.ABC):
    """What the server holds of a running engine: submit, cancel, and its
    load figures (read by /metrics, /v1/loads and /health when asked).

    A base class rather than a Protocol: the figures and the refusals that
    read them are the same for every engine, so they live here once."""

    def __init__(self, max_queued_requests: int, *, kv_capacity_tokens: int | None = None) -> None:
        self._max_queued_requests = max_queued_requests
        #: Requests submitted and not yet running.
        self.queued = 0
        self.running_requests = 0
        #: Sequences (a request's choices) running.
        self.running_rows = 0
        #: Tokens held in the running sequences' KV caches.
        self.cached_tokens = 0
        #: Tokens the KV caches can hold at most (None: every row at full context).
        self.kv_capacity_tokens = kv_capacity_tokens
        #: Requests whose reader is too far behind.
        self.paused_requests = 0
        #: False while the engine is lost (being restarted, or given up on).
        self.engine_available = True
        #: Why new requests are refused (the server draining), if they are.
        self.refusal: str | None = None
        #: The prefix cache's counters, when the handle keeps them.
        self.prefix_cache: PrefixCacheStats | None = None

    def admit(self, waiting: int) -> None:
        """Refuse a new request, given the ``waiting`` requests already in
        front of it that no free sequence takes at once: 503 while the server
        drains or the engine is lost, 429 at the bounded queue's limit."""
        if self.refusal is not None:
            raise ServiceUnavailable(self.refusal)
        if not self.engine_available:
            raise ServiceUnavailable("the engine is restarting; retry shortly")
        if waiting >= self._max_queued_requests:
            raise Overloaded(f"the server has {waiting} requests waiting, its limit; retry shortly")

    @abc.abstractmethod
    def submit(
        self,
        request: GenerationRequest,
        output: Outbox[RequestOutput],
        *,
        backlog: Backlog | None = None,
    ) -> None:
        """Start ``request``; its messages go to ``output``, which is closed
        when the request ends. Raises an ``ApiError`` to refuse it (the queue
        is full, the engine is restarting, a field the engine cannot honour)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """End the request now (its client went away); its output is closed."""

    @abc.abstractmethod
    def resume(self, request_id: str) -> None:
        """The request's reader has caught up with its backlog."""

    @abc.abstractmethod
    def finish_choice(self, request_id: str, choice: int) -> None:
        """The output actor ended a choice (a stop string matched)."""

    @abc.abstractmethod
    def close(self) -> None:
        """No more submissions."""
