"""What the handlers share once the model is loaded: read-only after start-up."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sluiceway.actors.scheduler import SchedulerHandle
from sluiceway.server.config import ServerConfig
from sluiceway.server.parsing import ParserChoice
from sluiceway.server.runtime import LoadedModel


@dataclass(frozen=True, slots=True)
class ServerState:
    config: ServerConfig
    model: LoadedModel
    scheduler: SchedulerHandle
    parsers: ParserChoice

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def vocab_size(self) -> int:
        return self.model.engine.info.vocab_size

    @property
    def max_context(self) -> int:
        return self.model.engine.info.max_context


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
