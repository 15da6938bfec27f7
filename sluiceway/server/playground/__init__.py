"""The playground page: static files shipped inside the package, served at
``/`` and ``/playground`` (the page) and ``/playground/NAME`` (its scripts
and style sheet).

The page holds no secret and talks only to this server's own API with the key
the user types, so it answers without an API key. The files are read once,
when the routes are built, and never change while the server runs; each
response carries a strong ETag (a hash of the bytes) and ``no-cache``, so a
browser revalidates with ``If-None-Match`` and gets a 304 until the package
is upgraded. A strict Content-Security-Policy allows scripts, styles and
connections from this origin only: no inline script, no ``eval``, no other
host, so even text a model writes into the page could not run or leak.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

from sluiceway.protocol.errors import NotFound
from sluiceway.server.http import Receive, Scope, Send
from sluiceway.server.routing import Handler

#: Where the page answers, and where its other files live.
PAGE_PATHS = ("/", "/playground")
ASSET_PREFIX = "/playground/"
PAGE = "index.html"

CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
}

CONTENT_SECURITY_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

COMMON_HEADERS = (
    (b"cache-control", b"no-cache"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Asset:
    """One file of the page, as it is served."""

    body: bytes
    content_type: bytes
    etag: bytes


def load_assets() -> Mapping[str, Asset]:
    """Every servable file of this package, by file name."""
    assets: dict[str, Asset] = {}
    for entry in resources.files(__name__).iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            body = entry.read_bytes()
            etag = b'"' + hashlib.sha256(body).hexdigest()[:32].encode() + b'"'
            assets[entry.name] = Asset(body=body, content_type=CONTENT_TYPES[suffix], etag=etag)
    return MappingProxyType(assets)


def public_paths(assets: Mapping[str, Asset]) -> frozenset[str]:
    """The paths that answer without an API key (none when the page is off)."""
    if not assets:
        return frozenset()
    return frozenset({*PAGE_PATHS, *(ASSET_PREFIX + name for name in assets if name != PAGE)})


def _not_modified(scope: Scope, etag: bytes) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"if-none-match":
            tags = {tag.strip().removeprefix(b"W/") for tag in value.split(b",")}
            return etag in tags or b"*" in tags
    return False


async def _send_asset(asset: Asset, scope: Scope, send: Send) -> None:
    headers = [*COMMON_HEADERS, (b"etag", asset.etag)]
    if _not_modified(scope, asset.etag):
        await send({"type": "http.response.start", "status": 304, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    headers += [
        (b"content-type", asset.content_type),
        (b"content-length", str(len(asset.body)).encode()),
    ]
    body = b"" if scope["method"] == "HEAD" else asset.body
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def routes(assets: Mapping[str, Asset]) -> dict[str, Mapping[str, Handler]]:
    """Route-table entries for the page and its files (``HEAD`` falls back
    to ``GET`` in the router)."""

    async def page(scope: Scope, receive: Receive, send: Send) -> None:
        await _send_asset(assets[PAGE], scope, send)

    async def asset(scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path"].removeprefix(ASSET_PREFIX)
        if name == PAGE or name not in assets:
            raise NotFound(f"no route for {scope['path']}", code="unknown_url")
        await _send_asset(assets[name], scope, send)

    return {
        **{path: {"GET": page} for path in PAGE_PATHS},
        ASSET_PREFIX + "{asset}": {"GET": asset},
    }
