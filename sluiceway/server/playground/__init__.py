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

from sluiceway.surfaces.base import Call, Headers, Serving, SurfaceHandler

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


def _not_modified(headers: Headers, etag: bytes) -> bool:
    for name, value in headers:
        if name == b"if-none-match":
            tags = {tag.strip().removeprefix(b"W/") for tag in value.split(b",")}
            return etag in tags or b"*" in tags
    return False


async def _send_asset(asset: Asset, call: Call) -> None:
    headers = [*COMMON_HEADERS, (b"etag", asset.etag)]
    if _not_modified(call.headers, asset.etag):
        await call.send_bytes(304, b"", headers)
        return
    await call.send_bytes(200, asset.body, [*headers, (b"content-type", asset.content_type)])


def routes(assets: Mapping[str, Asset]) -> dict[str, Mapping[str, SurfaceHandler]]:
    """Route-table entries for the page and each of its files, by literal
    path: any other path under ``/playground/`` has no route, so a client
    without the API key learns nothing of it (``HEAD`` falls back to ``GET``
    in the router)."""

    def serve(asset: Asset) -> SurfaceHandler:
        async def handler(serving: Serving, call: Call) -> None:
            await _send_asset(asset, call)

        return handler

    page = serve(assets[PAGE])
    return {
        **{path: {"GET": page} for path in PAGE_PATHS},
        **{
            ASSET_PREFIX + name: {"GET": serve(asset)}
            for name, asset in assets.items()
            if name != PAGE
        },
    }
