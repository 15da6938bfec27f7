"""The playground's routes over plain HTTP, on the real server: the page and
its files answer without the API key (the API still needs it), with their
content types, caching and security headers; HEAD; --no-playground."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.harness import RunningServer, serving
from tests.fixtures.scripted_model import ScriptedModel

pytestmark = pytest.mark.e2e

FILES = {
    "/": "text/html; charset=utf-8",
    "/playground": "text/html; charset=utf-8",
    "/playground/app.js": "text/javascript; charset=utf-8",
    "/playground/align.js": "text/javascript; charset=utf-8",
    "/playground/style.css": "text/css; charset=utf-8",
}


def test_the_page_and_its_files_need_no_key(keyed_server: RunningServer) -> None:
    for path, content_type in FILES.items():
        reply = httpx.get(keyed_server.base_url + path, timeout=10)
        assert reply.status_code == 200, path
        assert reply.headers["content-type"] == content_type
        assert reply.headers["x-content-type-options"] == "nosniff"
        assert reply.headers["cache-control"] == "no-cache"
        csp = reply.headers["content-security-policy"]
        assert "default-src 'none'" in csp
        assert "script-src 'self';" in csp
        assert "connect-src 'self';" in csp
        assert "unsafe" not in csp
    page = httpx.get(keyed_server.base_url + "/", timeout=10).text
    assert "<title>sluiceway playground</title>" in page
    assert '<script type="module" src="/playground/app.js">' in page


def test_the_api_still_needs_the_key(keyed_server: RunningServer) -> None:
    base = keyed_server.base_url
    assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(base + "/v1/models", headers=keyed_server.auth, timeout=10).status_code == 200
    # Only the page's own files are public; anything else under /playground/ is not.
    assert httpx.get(base + "/playground/secret.txt", timeout=10).status_code == 401
    missing = httpx.get(base + "/playground/secret.txt", headers=keyed_server.auth, timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "unknown_url"
    wrong = httpx.post(base + "/", timeout=10)
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "GET"


def test_etag_head_and_revalidation(keyed_server: RunningServer) -> None:
    url = keyed_server.base_url + "/playground/app.js"
    full = httpx.get(url, timeout=10)
    etag = full.headers["etag"]
    assert etag.startswith('"')
    again = httpx.get(url, headers={"if-none-match": etag}, timeout=10)
    assert again.status_code == 304
    assert again.content == b""
    assert again.headers["etag"] == etag
    head = httpx.head(url, timeout=10)
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == str(len(full.content))
    assert head.headers["etag"] == etag


@pytest.fixture(scope="module")
def plain_server(
    scripted: ScriptedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with serving(scripted.path, tmp_path_factory.mktemp("logs"), "--no-playground") as running:
        yield running


def test_no_playground_turns_it_off(plain_server: RunningServer) -> None:
    for path in FILES:
        reply = httpx.get(plain_server.base_url + path, timeout=10)
        assert reply.status_code == 404, path
        assert reply.json()["error"]["type"] == "not_found_error"
    assert httpx.get(plain_server.api_url + "/models", timeout=10).status_code == 200
