"""Cross-origin requests from browsers (``--allowed-origins``; off by default).

With no allowed origins the server sends no CORS header at all, and a
browser on another origin cannot read its replies. An allowed origin gets
``Access-Control-Allow-Origin`` on every reply, and its preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) is answered 204 before
routing and authentication, as browsers send preflights without credentials.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluiceway.surfaces.base import Headers

#: How long a browser may cache a preflight's answer.
MAX_AGE_SECONDS = b"600"


def _header(headers: Headers, name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


@dataclass(frozen=True, slots=True)
class Cors:
    origins: frozenset[str]

    def allowed(self, headers: Headers) -> bytes | None:
        """The request's ``Origin`` if it may read the reply."""
        if not self.origins:
            return None
        origin = _header(headers, b"origin")
        if origin is None:
            return None
        if "*" in self.origins or origin.decode("latin-1") in self.origins:
            return origin
        return None

    def reply_headers(self, headers: Headers) -> list[tuple[bytes, bytes]]:
        origin = self.allowed(headers)
        if origin is None:
            return []
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-expose-headers", b"x-request-id"),
            (b"vary", b"origin"),
        ]

    def preflight(self, method: str, headers: Headers) -> list[tuple[bytes, bytes]] | None:
        """The headers of a 204 answering a preflight (beside
        :meth:`reply_headers`, which every reply gets), or None if this is
        not one the server answers."""
        if method != "OPTIONS" or _header(headers, b"access-control-request-method") is None:
            return None
        if self.allowed(headers) is None:
            return None
        asked = _header(headers, b"access-control-request-headers") or b""
        return [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", MAX_AGE_SECONDS),
        ]
