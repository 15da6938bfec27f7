"""The playground's fixtures: the scripted model served with an API key (under
both Hypercorn worker classes), and a real headless chromium driven by
playwright."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, sync_playwright

from tests.e2e.harness import RunningServer, ServerPool
from tests.e2e.playground.page import API_KEY
from tests.fixtures.scripted_model import ScriptedModel

#: Debian's chromium; playwright drives it (its own browser builds are never installed).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Where the screenshots go (listed in .gitignore).
ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts" / "playground"


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def keyed_server(
    request: pytest.FixtureRequest, scripted: ScriptedModel, servers: ServerPool
) -> RunningServer:
    """The scripted model behind ``--api-key``, per worker class (from the
    worker's pool, so both playground files share it)."""
    running = servers.get(
        scripted.path,
        worker_class=request.param,
        name="scripted",
        extra_args=["--api-key", API_KEY],
    )
    running.api_key = API_KEY
    running.pace_fields = {"chat_template_kwargs": {"script": "bytes_stop"}}
    return running


# Module scope, not session: playwright's sync API keeps an asyncio loop
# marked running in this thread while it is open, and the async tests of
# other modules could not start theirs.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing (make test installs Debian's chromium when run as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    yield launched
    launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page (its own storage) at desktop size. Uncaught errors and
    Content-Security-Policy violations fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    opened = context.new_page()
    problems: list[str] = []

    def console(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text or "Refused to" in message.text:
            problems.append(message.text)

    opened.on("console", console)
    opened.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    yield opened
    context.close()
    assert not problems, problems


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
