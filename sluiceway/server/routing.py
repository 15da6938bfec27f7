"""A small router: path -> method -> handler, telling 404 from 405.

Paths are literal, or have whole segments in braces (``/v1/models/{model}``)
that match any one non-empty segment; the handler reads it from the path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from sluiceway.protocol.errors import MethodNotAllowed, NotFound
from sluiceway.server.http import Receive, Scope, Send

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


def _matches(pattern: tuple[str, ...], segments: tuple[str, ...]) -> bool:
    if len(pattern) != len(segments):
        return False
    return all(
        (p.startswith("{") and p.endswith("}") and s) or p == s
        for p, s in zip(pattern, segments, strict=True)
    )


@dataclass(frozen=True, slots=True)
class Router:
    """Routes built once at start-up and never mutated."""

    routes: Mapping[str, Mapping[str, Handler]]
    _patterns: tuple[tuple[tuple[str, ...], str], ...] = field(init=False)

    def __post_init__(self) -> None:
        patterns = tuple((tuple(path.strip("/").split("/")), path) for path in self.routes)
        object.__setattr__(self, "_patterns", patterns)

    def resolve(self, method: str, path: str) -> Handler:
        segments = tuple(path.strip("/").split("/"))
        methods = self.routes.get("/" + "/".join(segments))
        if methods is None:
            for pattern, route in self._patterns:
                if _matches(pattern, segments):
                    methods = self.routes[route]
                    break
        if methods is None:
            raise NotFound(f"no route for {path}", code="unknown_url")
        handler = methods.get(method)
        if handler is None and method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            raise MethodNotAllowed(
                f"{method} is not allowed on {path}", allowed=tuple(sorted(methods))
            )
        return handler
