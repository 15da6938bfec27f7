"""Driving the playground page as a user does: type the key, set fields, send."""

from __future__ import annotations

import json
from typing import Any

import httpx
from playwright.sync_api import Page

from tests.e2e.harness import RunningServer
from tests.e2e.scripts import PLAYGROUND

API_KEY = "playground-test-key"

#: What the page shows of the playground script: each channel's token spans
#: (the "}" of "}}\n" closes the arguments; the rest of it is envelope).
REASONING_SPANS = list(PLAYGROUND.pieces[1:6])
CONTENT_SPANS = list(PLAYGROUND.pieces[8:12])
ARGUMENT_SPANS = ['{"city": ', '"Paris"', "}"]
#: Tokens with no visible text: <think>, </think>, "\n\n", <tool_call>, "\n",
#: '{"name": ', '"get_weather"', ', "arguments": ', </tool_call>, EOS.
MARKUP_TOKENS = 10

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city's name"}},
                "required": ["city"],
            },
        },
    }
]


def open_page(page: Page, server: RunningServer, *, key: str = API_KEY) -> Page:
    """The page, with the key typed in and the model list loaded."""
    page.goto(server.base_url + "/")
    page.fill("#api-key", key)
    page.press("#api-key", "Enter")
    page.wait_for_selector(f"#model option[value='{server.model}']", state="attached")
    return page


def script(page: Page, name: str, **extra: Any) -> None:
    """Select a scripted model's script (and any other fields) through the
    page's extra-fields editor."""
    fields = {"chat_template_kwargs": {"script": name}, **extra}
    page.fill("#extra", json.dumps(fields))


def send(page: Page, text: str) -> None:
    page.fill("#message", text)
    page.click("#send")


def wait_done(page: Page, turn: int = -1) -> None:
    """Wait until a turn's finish reason is shown (the last turn by default)."""
    index = page.locator(".msg.assistant").count() - 1 if turn < 0 else turn
    page.locator(".msg.assistant").nth(index).locator("[data-stat=finish_reason]").wait_for()


def spans(page: Page, selector: str) -> list[str]:
    """The texts of the heat-map spans under ``selector``."""
    texts: list[str] = page.locator(f"{selector} .tok").evaluate_all(
        "s => s.map(e => e.textContent)"
    )
    return texts


def shown_text(page: Page, selector: str) -> str:
    """The text under ``selector`` as shown: markup tokens (hidden) left out."""
    text: str = page.locator(selector).first.evaluate(
        "node => { const copy = node.cloneNode(true);"
        " copy.querySelectorAll('.markup').forEach(m => m.remove()); return copy.textContent; }"
    )
    return text


def stat(page: Page, key: str, turn: int = -1) -> str:
    assistant = page.locator(".msg.assistant").nth(turn)
    return str(assistant.locator(f"[data-stat={key}]").inner_text())


def api_reply(server: RunningServer, script_name: str, **fields: Any) -> dict[str, Any]:
    """The same request the page sends, made without it (not streamed)."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "logprobs": True,
        "top_logprobs": 5,
        "tools": TOOLS,
        "chat_template_kwargs": {"script": script_name},
        **fields,
    }
    reply = httpx.post(
        server.api_url + "/chat/completions", json=body, headers=server.auth, timeout=60
    )
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()
    return result
