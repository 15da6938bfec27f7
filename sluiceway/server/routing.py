"""A small router: path -> method -> route, telling 404 from 405.

Paths are literal, or have whole segments in braces (``/v1/models/{model}``)
that match any one non-empty segment; :meth:`Router.resolve` hands their
values to the caller by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sluiceway.protocol.errors import MethodNotAllowed, NotFound

R = TypeVar("R")

Pattern = tuple[str, ...]


def _match(pattern: Pattern, segments: Pattern) -> dict[str, str] | None:
    """The path parameters, if the segments match the pattern."""
    if len(pattern) != len(segments):
        return None
    params: dict[str, str] = {}
    for part, segment in zip(pattern, segments, strict=True):
        if part.startswith("{") and part.endswith("}"):
            if not segment:
                return None
            params[part[1:-1]] = segment
        elif part != segment:
            return None
    return params


@dataclass(frozen=True, slots=True)
class Router(Generic[R]):
    """Routes built once at start-up and never mutated."""

    routes: Mapping[str, Mapping[str, R]]
    _patterns: tuple[tuple[Pattern, str], ...] = field(init=False)

    def __post_init__(self) -> None:
        patterns = tuple((tuple(path.strip("/").split("/")), path) for path in self.routes)
        object.__setattr__(self, "_patterns", patterns)

    def resolve(self, method: str, path: str) -> tuple[R, Mapping[str, str]]:
        """The route for ``method`` on ``path`` and the path's parameters."""
        segments = tuple(path.strip("/").split("/"))
        params: Mapping[str, str] = {}
        methods = self.routes.get("/" + "/".join(segments))
        if methods is None:
            for pattern, route in self._patterns:
                found = _match(pattern, segments)
                if found is not None:
                    methods, params = self.routes[route], found
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
        return handler, params


def merge_routes(
    *tables: Mapping[str, Mapping[str, R]],
) -> dict[str, dict[str, R]]:
    """One table from several; a path and method claimed twice is a start-up error."""
    merged: dict[str, dict[str, R]] = {}
    for table in tables:
        for path, methods in table.items():
            slot = merged.setdefault(path, {})
            for method, route in methods.items():
                if method in slot:
                    raise ValueError(f"{method} {path} is routed twice")
                slot[method] = route
    return merged
