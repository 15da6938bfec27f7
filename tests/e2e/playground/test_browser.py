"""The playground in a real headless chromium against the real server on the
scripted model: every channel streams into its place, every visible token is
one heat-map span whose inspector shows the API's logprob, Stop cancels on
the server, and the history, settings and errors reach the user."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, Request, Route

from tests.e2e.harness import RunningServer, assert_freed_promptly, seconds_per_token
from tests.e2e.playground.page import (
    API_KEY,
    ARGUMENT_SPANS,
    CONTENT_SPANS,
    MARKUP_TOKENS,
    REASONING_SPANS,
    api_reply,
    open_page,
    script,
    send,
    shown_text,
    spans,
    stat,
    wait_done,
)

pytestmark = pytest.mark.e2e

PROMPT = "What is the weather in Paris?"


def scripted_turn(page: Page, server: RunningServer) -> Page:
    open_page(page, server)
    page.click("#tools-example")
    script(page, "playground")
    send(page, PROMPT)
    wait_done(page)
    return page


def test_every_channel_streams_into_its_place(
    page: Page, keyed_server: RunningServer, artifacts: Path
) -> None:
    scripted_turn(page, keyed_server)
    assert shown_text(page, "details.reasoning .run") == "".join(REASONING_SPANS)
    assert shown_text(page, ".run.content") == "".join(CONTENT_SPANS)
    card = page.locator(".tool-call")
    assert card.count() == 1
    assert card.locator(".tool-name").inner_text() == "get_weather"
    assert card.locator(".tool-id").inner_text().startswith("call_")
    assert shown_text(page, ".tool-call .run.args") == '{"city": "Paris"}'

    # One span per visible token, per channel, in order.
    assert spans(page, "details.reasoning") == REASONING_SPANS
    assert spans(page, ".run.content") == CONTENT_SPANS
    assert spans(page, ".tool-call") == ARGUMENT_SPANS
    usage = api_reply(keyed_server, "playground")["usage"]
    assert stat(page, "completion_tokens") == str(usage["completion_tokens"])
    assert page.locator(".tok").count() == usage["completion_tokens"] - MARKUP_TOKENS
    assert stat(page, "markup_tokens") == str(MARKUP_TOKENS)
    assert stat(page, "finish_reason") == "tool_calls"
    assert float(stat(page, "ttft_ms").removesuffix(" ms")) >= 0

    # Markup tokens are there to see on request, and are not heat-map spans.
    assert page.locator(".markup").first.is_hidden()
    page.check("#show-markup")
    markup = page.locator(".markup").evaluate_all("s => s.map(e => e.textContent)")
    assert len(markup) == MARKUP_TOKENS
    assert {"<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"} <= set(markup)
    page.uncheck("#show-markup")

    # The inspector in the picture, opening below the token (scrolled so it fits).
    page.mouse.wheel(0, 2000)
    page.locator(".tool-call .tok").nth(1).hover()
    page.screenshot(path=str(artifacts / "desktop.png"), full_page=True)
    page.mouse.move(0, 0)
    page.set_viewport_size({"width": 390, "height": 844})
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page is {width} px wide at phone width"
    page.screenshot(path=str(artifacts / "phone.png"), full_page=True)


def inspector(page: Page) -> dict[str, Any]:
    box = page.locator("#inspector")
    box.wait_for()
    rows = box.locator(".insp-alternatives tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )
    return {
        "token": json.loads(box.locator(".insp-token").inner_text()),
        "logprob": float(box.locator(".insp-logprob").inner_text()),
        "alternatives": [(json.loads(token), float(logprob)) for token, logprob, _ in rows],
    }


def assert_matches(shown: dict[str, Any], entry: dict[str, Any]) -> None:
    assert shown["token"] == entry["token"]
    assert math.isclose(shown["logprob"], entry["logprob"], abs_tol=1e-4)
    expected = [(alt["token"], alt["logprob"]) for alt in entry["top_logprobs"]]
    assert [token for token, _ in shown["alternatives"]] == [token for token, _ in expected]
    for (_, got), (_, want) in zip(shown["alternatives"], expected, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4)


def test_hover_and_keyboard_show_the_apis_logprobs(page: Page, keyed_server: RunningServer) -> None:
    scripted_turn(page, keyed_server)
    logprobs = api_reply(keyed_server, "playground")["choices"][0]["logprobs"]
    content = logprobs["content"]

    page.locator(".run.content .tok").nth(1).hover()
    assert_matches(inspector(page), content[1])
    page.locator(".tool-call .tok").nth(1).hover()
    paris = next(e for e in logprobs["tool_calls"] if e["token"] == '"Paris"')
    assert_matches(inspector(page), paris)

    # Keyboard: one tab stop per run, arrows move between its tokens.
    page.locator(".run.content .tok").first.focus()
    assert_matches(inspector(page), content[0])
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert_matches(inspector(page), content[2])
    page.keyboard.press("End")
    assert inspector(page)["token"] == CONTENT_SPANS[-1]
    page.keyboard.press("Escape")
    assert page.locator("#inspector").is_hidden()
    tab_stops = page.locator(".run.content .tok[tabindex='0']").count()
    assert tab_stops == 1


def test_stop_ends_the_stream_and_the_server_cancels(
    page: Page, keyed_server: RunningServer
) -> None:
    max_tokens = 6000
    seconds_per_token(keyed_server)  # timed before, on an idle server
    open_page(page, keyed_server)
    script(page, "bytes_stop")
    page.fill("#max-tokens", str(max_tokens))
    send(page, "Loop, please.")
    page.locator(".run.content .tok").nth(29).wait_for()
    page.click("#stop")
    stopped = time.monotonic()
    page.locator(".turn-note", has_text="Stopped.").wait_for()
    shown = page.locator(".run.content .tok").count()
    assert shown < max_tokens // 2
    assert page.locator("#send").is_enabled()
    assert page.locator("#stop").is_disabled()
    assert_freed_promptly(keyed_server, left=max_tokens - shown, since=stopped)

    # A character split over two tokens belongs to the token that completes it;
    # the fragment before it is markup.
    first = spans(page, ".run.content")[:9]
    assert first == ["Caf", "é", " costs", " 3", "€", " S", "TO", "P!", " tail."]


def test_history_settings_and_key_go_out_with_the_request(
    page: Page, keyed_server: RunningServer
) -> None:
    scripted_turn(page, keyed_server)
    call_id = page.locator(".tool-call .tool-id").inner_text()
    page.fill(".tool-call .tool-result textarea", "Sunny, 21 °C")
    page.click(".tool-call .tool-result button")
    assert page.locator(".msg.tool").inner_text().endswith("Sunny, 21 °C")

    page.fill("#system-prompt", "Be brief.")
    for field, value in {
        "#temperature": "0.5",
        "#top-p": "0.9",
        "#top-k": "40",
        "#max-tokens": "64",
        "#seed": "7",
        "#top-logprobs": "3",
    }.items():
        page.fill(field, value)
    page.fill("#stop-strings", "END\nSTOP")
    page.select_option("#thinking", "false")
    page.select_option("#tool-choice", "none")
    with page.expect_request("**/v1/chat/completions") as caught:
        page.click("#send")  # an empty message continues after the tool result
    request: Request = caught.value
    wait_done(page)

    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    body = request.post_data_json
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPT},
        {
            "role": "assistant",
            "content": "".join(CONTENT_SPANS),
            "reasoning_content": "".join(REASONING_SPANS),
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 °C"},
    ]
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "seed")} == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "max_tokens": 64,
        "seed": 7,
    }
    assert body["stop"] == ["END", "STOP"]
    assert body["logprobs"] is True
    assert body["top_logprobs"] == 3
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "script": "playground"}
    assert body["tool_choice"] == "none"
    assert body["stream_options"] == {"include_usage": True}
    assert page.locator(".msg.assistant").count() == 2

    # The key stays in the page's memory: nothing in storage or cookies.
    stored = page.evaluate("[localStorage.length, sessionStorage.length, document.cookie]")
    assert stored == [0, 0, ""]


def test_errors_reach_the_user(page: Page, keyed_server: RunningServer) -> None:
    open_page(page, keyed_server)
    sent: list[Request] = []
    page.on("request", lambda r: sent.append(r) if "/chat/completions" in r.url else None)

    # Tools are checked before anything is sent.
    page.fill("#tools", '[{"type": "function", "function": {}}]')
    send(page, "Hi")
    assert "tools[0].function.name" in page.locator("#error").inner_text()
    assert page.locator("#tools").get_attribute("aria-invalid") == "true"
    page.fill("#tools", "[not json")
    assert "not valid JSON" in page.locator("#tools-error").inner_text()
    assert sent == []
    page.fill("#tools", "")

    # The server's OpenAI error body; the message goes back into the box.
    script(page, "playground", bogus_field=1)
    send(page, "Hi")
    page.locator("#error", has_text="bogus_field").wait_for()
    assert "HTTP 400" in page.locator("#error").inner_text()
    assert page.locator("#message").input_value() == "Hi"
    assert page.locator(".msg").count() == 0

    # An error event after the stream started ends the turn and is shown.
    frames = [
        {"choices": [{"index": 0, "delta": {"content": "Half"}, "logprobs": None}]},
        {
            "error": {
                "message": "the engine failed",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        },
    ]
    body = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"

    def fake(route: Route) -> None:
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fake)
    script(page, "playground")
    send(page, "Hi again")
    page.locator(".turn-note.error", has_text="the engine failed").wait_for()
    assert page.locator(".run.content").inner_text() == "Half"
    page.unroute("**/v1/chat/completions")

    # A wrong key: the model list says so.
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    page.locator("#error", has_text="HTTP 401").wait_for()


def contrast(foreground: str, background: str) -> float:
    def luminance(css: str) -> float:
        channels = [int(v) / 255 for v in css[css.index("(") + 1 : css.index(")")].split(",")[:3]]
        linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    high, low = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_labels_contrast_and_phone_width(page: Page, keyed_server: RunningServer) -> None:
    scripted_turn(page, keyed_server)
    unlabelled = page.evaluate(
        """[...document.querySelectorAll('input, select, textarea, button')]
           .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                        && !(e.tagName === 'BUTTON' && e.textContent.trim()))
           .map(e => e.outerHTML)"""
    )
    assert unlabelled == []
    # Every heat-map colour, and the other text on tinted backgrounds, is AA.
    pairs = page.evaluate(
        """[...document.querySelectorAll('.swatch, .tok, .note, .msg .role, button, .tool-json')]
           .map(e => { const s = getComputedStyle(e); let b = e, bg;
                       do { bg = getComputedStyle(b).backgroundColor; b = b.parentElement; }
                       while (b && (bg === 'rgba(0, 0, 0, 0)'));
                       return [e.className || e.tagName, s.color, bg]; })"""
    )
    for name, foreground, background in pairs:
        assert contrast(foreground, background) >= 4.5, (name, foreground, background)
    assert page.locator(".swatch").count() == 6
    assert page.locator("#conversation").get_attribute("aria-busy") == "false"
    assert page.locator("#status").get_attribute("aria-live") == "polite"
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    # At phone width a tapped token's inspector docks at the bottom of the screen.
    page.locator(".run.content .tok").first.click()
    box = page.locator("#inspector").bounding_box()
    assert box is not None
    assert box["width"] == pytest.approx(390, abs=1)
    assert box["y"] + box["height"] == pytest.approx(844, abs=1)


#: Cutting one chunk's text among the entries that ride with it (align.js):
#: (text, entry pieces as bytes) -> the items, as (kind, text) pairs.
ALIGNMENT_CASES = [
    # A character split over two tokens belongs to the one that completes it.
    ("é", [b"\xc3", b"\xa9"], [("markup", ""), ("token", "é")]),
    # Whitespace a parser dropped in front of a token's text.
    ("Use", [b"\n\nUse"], [("token", "Use")]),
    # The part of a token that is there; the rest was envelope.
    ("}", [b"}}\n", b"</tool_call>"], [("token", "}"), ("markup", "")]),
    # Markup riding in front of the token whose text starts the chunk, even
    # markup that starts like that text.
    (
        '{"city": ',
        [b'{"name": ', b'"get_weather"', b', "arguments": ', b'{"city": '],
        [("markup", ""), ("markup", ""), ("markup", ""), ("token", '{"city": ')],
    ),
    # Text owned by a token of another channel stays unmarked.
    ("Hi there", [b" there"], [("text", "Hi"), ("token", " there")]),
    # A token with no text in the chunk at all (EOS on the final chunk).
    ("", [b"<|im_end|>"], [("markup", "")]),
]


def test_alignment_cases(page: Page, keyed_server: RunningServer) -> None:
    page.goto(keyed_server.base_url + "/")
    got = page.evaluate(
        """async (cases) => {
             const { ChannelAligner, splitItems } = await import("/playground/align.js");
             const entry = (bytes) => ({ token: "t", logprob: 0, bytes });
             const aligned = cases.map(([text, pieces]) =>
               new ChannelAligner().align(text, pieces.map(entry))
                 .map((item) => [item.kind, item.kind === "markup" ? "" : item.text]));
             // Two calls' arguments in one chunk: the envelope between them goes
             // with the second call.
             const texts = ['{"a": 1}', '{"b": 2}'];
             const pieces = ['{"a": 1}', "</tool_call>", '{"b": 2}'].map(
               (p) => entry([...new TextEncoder().encode(p)]));
             const split = splitItems(new ChannelAligner().align(texts.join(""), pieces), texts)
               .map((part) => part.map((item) => item.kind));
             return { aligned, split };
           }""",
        [[text, [list(piece) for piece in pieces]] for text, pieces, _ in ALIGNMENT_CASES],
    )
    assert got["aligned"] == [[list(item) for item in items] for _, _, items in ALIGNMENT_CASES]
    assert got["split"] == [["token"], ["markup", "token"]]


def test_sse_decoder_any_split(page: Page, keyed_server: RunningServer) -> None:
    """The page's SSE decoder gives the same events however the body is cut:
    whole, at every point, and one character at a time (CRLF and CR line
    ends, comments, multi-line data)."""
    sample = (
        ": keepalive\r\n\r\n"
        'data: {"a": 1}\r\n\r\n'
        "data: one\r\ndata: two\r\n\r\n"
        "event: x\rdata: first\rdata: second\r\r"
        'data:{"b": "é"}\n\n'
        "data: [DONE]\n\n"
    )
    page.goto(keyed_server.base_url + "/")
    got = page.evaluate(
        """async (text) => {
             const { SseDecoder } = await import("/playground/sse.js");
             const run = (pieces) => { const d = new SseDecoder(); return pieces.flatMap((p) => d.feed(p)); };
             const whole = run([text]);
             const splits = [...text].map((_, i) => run([text.slice(0, i), text.slice(i)]));
             return { whole, splits, chars: run([...text]) };
           }""",
        sample,
    )
    expected = ['{"a": 1}', "one\ntwo", "first\nsecond", '{"b": "é"}', "[DONE]"]
    assert got["whole"] == expected
    assert got["chars"] == expected
    assert all(split == expected for split in got["splits"])
