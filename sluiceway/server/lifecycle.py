"""The server's life: loading, serving, draining, and what /health and
/ready say about it.

The model loads after Hypercorn is listening, so that /health and /ready can
answer (503) while it loads, and /metrics is there from the start. Liveness
(/health) is 200 while the process can serve: loaded, and its engine there
(an engine in a child process that died is being restarted: 503 until it is
back, or for good if it could not be). Readiness (/ready) is liveness and
not draining.

Draining (SIGTERM or SIGINT under ``sluiceway serve``): new generation
requests are refused with 503 in the route's surface's shape and /ready
answers 503, while Hypercorn keeps listening; running requests go on until
they end or ``--shutdown-timeout`` passes, when each is ended with its
surface's failure event (see :mod:`sluiceway.server.supervision`). Then
Hypercorn closes the listener and the process exits.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import anyio

from sluiceway.actors.prefix_cache import PrefixCacheStats
from sluiceway.actors.scheduler import Restartable
from sluiceway.actors.seam import EngineHandle
from sluiceway.protocol.messages import FailureCause
from sluiceway.server.config import ServerConfig
from sluiceway.server.metrics import LoadSnapshot, Metrics
from sluiceway.server.runtime import LoadedModel
from sluiceway.server.supervision import Supervisor

logger = logging.getLogger(__name__)

#: After the grace period, how long the cut-off streams get to write their
#: failure events before the listener closes.
FLUSH_SECONDS = 5.0

SHUTTING_DOWN = "the server is shutting down"


class Phase(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    #: The model could not be loaded.
    FAILED = "failed"


@dataclass(slots=True)
class Lifecycle:
    """Where the server is in its life, and the parts that change with it."""

    config: ServerConfig
    metrics: Metrics
    supervisor: Supervisor
    phase: Phase = Phase.LOADING
    model: LoadedModel | None = None
    scheduler: EngineHandle | None = None
    #: Set when the server should stop on its own (the model failed to load).
    fatal: anyio.Event | None = field(default=None)

    def loaded(self, model: LoadedModel, scheduler: EngineHandle) -> None:
        self.model, self.scheduler = model, scheduler
        if self.phase is Phase.LOADING:
            self.phase = Phase.SERVING

    def failed(self) -> None:
        self.phase = Phase.FAILED
        if self.fatal is not None:
            self.fatal.set()

    def engine_available(self) -> bool:
        if self.scheduler is None or self.model is None:
            return False
        engine = self.model.engine
        if isinstance(engine, Restartable) and not engine.alive:
            return False
        return self.scheduler.engine_available

    def liveness(self) -> tuple[bool, str]:
        """Whether the process can serve (/health), and the word for its state."""
        if self.phase is Phase.FAILED:
            return False, "failed"
        if self.model is None:
            return False, "loading"
        if not self.engine_available():
            return False, "engine_unavailable"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        """Whether a new request should be sent here (/ready)."""
        alive, state = self.liveness()
        if alive and self.phase is Phase.DRAINING:
            return False, "draining"
        return alive, "ready" if alive else state

    def prefix_cache(self) -> PrefixCacheStats | None:
        return None if self.scheduler is None else self.scheduler.prefix_cache

    def load(self) -> LoadSnapshot | None:
        scheduler, model = self.scheduler, self.model
        if scheduler is None or model is None:
            return None
        return LoadSnapshot(
            running_requests=scheduler.running_requests,
            running_sequences=scheduler.running_rows,
            waiting_requests=scheduler.queued,
            paused_requests=scheduler.paused_requests,
            cached_tokens=scheduler.cached_tokens,
            capacity_tokens=(
                self.config.max_num_seqs * model.engine.info.max_context
                if scheduler.kv_capacity_tokens is None
                else scheduler.kv_capacity_tokens
            ),
            max_num_seqs=self.config.max_num_seqs,
            engine_available=self.engine_available(),
        )

    async def drain(self) -> None:
        """Stop admitting, let what runs finish within the grace period, then
        end the rest with their surfaces' failure events."""
        if self.phase is Phase.SERVING:
            self.phase = Phase.DRAINING
        if self.scheduler is not None:
            self.scheduler.refusal = SHUTTING_DOWN
        grace = self.config.shutdown_timeout
        running = self.supervisor.open_count
        logger.info("draining: %d request(s) running, up to %g s to finish", running, grace)
        if await self.supervisor.wait_empty(grace):
            return
        logger.warning(
            "shutdown timeout: ending %d request(s) still running", self.supervisor.open_count
        )
        await self.cut_short()

    async def cut_short(self) -> None:
        """End every running request now, and give their replies a moment
        to go out."""
        self.supervisor.fail_all(SHUTTING_DOWN, FailureCause.SHUTDOWN)
        await self.supervisor.wait_empty(FLUSH_SECONDS)
