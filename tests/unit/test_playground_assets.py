"""The playground's files: every file the page loads is served, and the
package data ships them in a wheel."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import cast

import pytest

from sluiceway.server import playground
from sluiceway.server.exchange import HttpCall, Submitter
from sluiceway.server.http import Message
from sluiceway.surfaces.base import Serving

ROOT = Path(__file__).resolve().parents[2]
ASSETS = playground.load_assets()


def referenced() -> set[str]:
    """Every file the page names: in index.html, and in each module's imports."""
    names = set(
        re.findall(r'(?:src|href)="/playground/([^"]+)"', ASSETS["index.html"].body.decode())
    )
    for name, asset in ASSETS.items():
        if name.endswith(".js"):
            names |= set(re.findall(r'from "\./([^"]+)"', asset.body.decode()))
    return names


def test_every_referenced_file_is_an_asset() -> None:
    names = referenced()
    assert {"app.js", "style.css", "sse.js", "align.js", "tokens.js", "turn.js"} <= names
    assert names <= set(ASSETS)
    assert {a.content_type for a in ASSETS.values()} == {
        b"text/html; charset=utf-8",
        b"text/javascript; charset=utf-8",
        b"text/css; charset=utf-8",
    }


def test_no_model_text_goes_through_innerhtml() -> None:
    for name, asset in ASSETS.items():
        text = asset.body.decode()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in text, f"{name} uses {sink}"


def test_a_wheel_ships_the_page(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "sluiceway", source / "sluiceway", ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for name in ASSETS:
        assert f"sluiceway/server/playground/{name}" in shipped


async def call(
    path: str, method: str = "GET", headers: tuple[tuple[bytes, bytes], ...] = ()
) -> list[Message]:
    sent: list[Message] = []
    handler = playground.routes(ASSETS)[path]["GET"]

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    # The page's handlers read nothing of the model or the scheduler.
    exchange = HttpCall(scope, receive, send, cast(Submitter, None), {}, 1024, 1.0)
    await handler(cast(Serving, None), exchange)
    return sent


@pytest.mark.anyio
async def test_if_none_match_and_head() -> None:
    etag = ASSETS["index.html"].etag
    start, body = await call("/", headers=((b"if-none-match", b'"other", W/' + etag),))
    assert start["status"] == 304
    assert body["body"] == b""
    start, body = await call("/playground", method="HEAD")
    headers = dict(start["headers"])
    assert start["status"] == 200
    assert headers[b"content-length"] == str(len(ASSETS["index.html"].body)).encode()
    assert body["body"] == b""
    start, body = await call("/playground/app.js", headers=((b"if-none-match", b'"stale"'),))
    assert start["status"] == 200
    assert body["body"] == ASSETS["app.js"].body


def test_only_the_pages_files_have_routes() -> None:
    routes = playground.routes(ASSETS)
    for path in ("/playground/index.html", "/playground/nope.js", "/playground/__init__.py"):
        assert path not in routes  # the router answers 404 (401 first without the key)
    assert {"/", "/playground", "/playground/app.js", "/playground/style.css"} <= set(routes)
