"""Compiling a request's constraint before it is submitted.

A surface calls :meth:`ConstraintCompiler.check` with the constraint it
translated: the grammar engine compiles it in a worker thread (the event loop
never waits on llguidance), a few at a time, and within the engine's time
limit; a constraint that does not compile is the client's error, a 400 that
names the request field and carries the engine's message. The compiled
grammar stays in the engine's cache, where the sampler finds it when the
request's rows start.
"""

from __future__ import annotations

import anyio

from sluiceway.engines.grammar import GrammarEngine, GrammarError
from sluiceway.protocol.constraints import Constraint
from sluiceway.protocol.errors import InvalidConstraint

#: Compiles running at once. Their own limiter, not anyio's default one: a
#: burst of slow compiles must not take the threads the sampler and the
#: logprob reducer step in.
COMPILE_CONCURRENCY = 2


class ConstraintCompiler:
    """Checks constraints against one grammar engine (or refuses them, without one)."""

    def __init__(self, grammars: GrammarEngine | None) -> None:
        self.grammars = grammars
        self._slots = anyio.CapacityLimiter(COMPILE_CONCURRENCY)
        # The thread runs under its own limiter: the slot above is what
        # queues compiles, and a compile the time limit abandons gives its
        # slot back at once (llguidance's own limits end its thread soon).
        self._threads = anyio.CapacityLimiter(COMPILE_CONCURRENCY * 4)

    async def check(self, constraint: Constraint, *, param: str) -> None:
        """Compile ``constraint`` (or find it compiled); raise
        :class:`InvalidConstraint` at ``param`` if it does not compile in time."""
        grammars = self.grammars
        if grammars is None:
            raise InvalidConstraint(
                "this server has no grammar engine for its model's tokenizer", param=param
            )
        limit = grammars.config.compile_seconds
        async with self._slots:
            try:
                with anyio.fail_after(limit):
                    await anyio.to_thread.run_sync(
                        grammars.compile, constraint, abandon_on_cancel=True, limiter=self._threads
                    )
            except TimeoutError:
                raise InvalidConstraint(
                    f"the {constraint.kind.value} did not compile within {limit:g} s; simplify it",
                    param=param,
                ) from None
            except GrammarError as error:
                raise InvalidConstraint(
                    f"invalid {constraint.kind.value}: {error}", param=param
                ) from None
