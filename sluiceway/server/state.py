"""What the server shares once the model is loaded: read-only after start-up."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from sluiceway.actors.constraints import ConstraintCompiler
from sluiceway.actors.seam import EngineHandle
from sluiceway.parsers.registry import ParserChoice
from sluiceway.server.config import ServerConfig
from sluiceway.server.runtime import LoadedModel
from sluiceway.surfaces.base import Serving
from sluiceway.surfaces.conversation import template_probes


@dataclass(frozen=True, slots=True)
class ServerState:
    config: ServerConfig
    model: LoadedModel
    scheduler: EngineHandle
    parsers: ParserChoice

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def serving(self) -> Serving:
        """What the surfaces' handlers see of it (built once, at start-up)."""
        template_kwargs = self.config.template_defaults()
        return Serving(
            model_name=self.model_name,
            created=self.model.created,
            engine=self.model.engine.info,
            tokenizer=self.model.tokenizer,
            parsers=self.parsers,
            max_num_seqs=self.config.max_num_seqs,
            max_top_logprobs=self.config.max_top_logprobs,
            stop_in_reasoning=self.config.stop_in_reasoning,
            default_template_kwargs=MappingProxyType(template_kwargs),
            prefix_preserving=MappingProxyType(
                template_probes(self.model.tokenizer, template_kwargs)
            ),
            constraints=ConstraintCompiler(self.model.grammars),
        )
