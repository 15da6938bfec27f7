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

from typing import Protocol

from sluiceway.actors.prefix_cache import PrefixCacheStats
from sluiceway.protocol.messages import Backlog, GenerationRequest, Outbox, RequestOutput


class EngineHandle(Protocol):
    """What the server holds of a running engine: submit, cancel, and its
    load figures (read by /metrics, /v1/loads and /health when asked)."""

    #: Requests submitted and not yet running.
    queued: int
    running_requests: int
    #: Sequences (a request's choices) running.
    running_rows: int
    #: Tokens held in the running sequences' KV caches.
    cached_tokens: int
    #: Tokens the KV caches can hold at most (None: every row at full context).
    kv_capacity_tokens: int | None
    #: Requests whose reader is too far behind.
    paused_requests: int
    #: False while the engine is lost (being restarted, or given up on).
    engine_available: bool
    #: Why new requests are refused (the server draining), if they are.
    refusal: str | None
    #: The prefix cache's counters, when the handle keeps them.
    prefix_cache: PrefixCacheStats | None

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
        ...

    def cancel(self, request_id: str) -> None:
        """End the request now (its client went away); its output is closed."""
        ...

    def resume(self, request_id: str) -> None:
        """The request's reader has caught up with its backlog."""
        ...

    def finish_choice(self, request_id: str, choice: int) -> None:
        """The output actor ended a choice (a stop string matched)."""
        ...

    def close(self) -> None:
        """No more submissions."""
        ...
