"""Multi-turn from the exact tokens (issue K), end to end on the scripted
model, whose template (Qwen-style) drops the reasoning of past assistant
turns: with the ids sent back on the assistant messages, every turn's prompt
begins with the previous turn's prompt and generated ids; without them it
does not."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.harness import RunningServer
from tests.e2e.test_parsing import TOOLS
from tests.e2e.test_tokens import events, streamed_ids
from tests.fixtures.scripted_model import EXAMPLE_STOP, ScriptedModel

CHAT = "/v1/chat/completions"
WORDS = st.text(alphabet="abc xyz.?", min_size=1, max_size=16)


@dataclass(frozen=True)
class Plan:
    """A conversation a client drives: which script the model follows (one
    per conversation: the scripted model follows one selector per context),
    its end, and what the client adds after each reply."""

    script: str
    system: str | None
    first: str
    turns: int
    #: After each reply: the user text to add (None: only the tool results).
    follow_ups: tuple[str | None, ...]
    #: Send the generated ids as ``token_ids`` (issue C's name) instead.
    synonym: bool
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None


@st.composite
def plans(draw: st.DrawFn, *, stop_strings: bool = True, synonyms: bool = True) -> Plan:
    """Conversations of 2-8 turns; ``stop_strings``: the surface has them
    (the Responses API has not); ``synonyms``: it takes ``token_ids`` too."""
    script = draw(st.sampled_from(["reasoning", "tool_call", "bytes_stop"]))
    turns = draw(st.integers(2, 8))
    stop: tuple[str, ...] = ()
    max_tokens = None
    if script == "bytes_stop":  # never ends by itself: a stop string or the length ends it
        if stop_strings and draw(st.booleans()):
            stop = (EXAMPLE_STOP,)
        else:
            max_tokens = draw(st.integers(1, 12))
    return Plan(
        script=script,
        system=draw(st.none() | WORDS),
        first=draw(WORDS),
        turns=turns,
        follow_ups=tuple(draw(st.none() | WORDS) for _ in range(turns - 1)),
        synonym=synonyms and draw(st.booleans()),
        stop=stop,
        max_tokens=max_tokens,
    )


#: The KV block that vLLM's prefix cache keeps whole (see below).
VLLM_BLOCK = 128


def chat(server: RunningServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + CHAT, json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _assistant(reply: dict[str, Any], plan: Plan, with_ids: bool) -> dict[str, Any]:
    """The reply's message as a client passes it back (ids included)."""
    (choice,) = reply["choices"]
    message = {k: v for k, v in choice["message"].items() if v is not None}
    if with_ids:
        message["prompt_token_ids"] = reply["prompt_token_ids"]
        message["token_ids" if plan.synonym else "generation_token_ids"] = choice["token_ids"]
    return message


def _after(message: dict[str, Any], follow_up: str | None) -> list[dict[str, Any]]:
    """What the client adds after a reply: the results of its tool calls, a
    user message, or both (a user message at least when nothing was called)."""
    added = [
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}
        for call in message.get("tool_calls", ())
    ]
    if follow_up is not None or not added:
        added.append({"role": "user", "content": follow_up or "go on"})
    return added


def converse(
    server: RunningServer, scripted: ScriptedModel, plan: Plan, *, with_ids: bool
) -> list[dict[str, Any]]:
    """Drive the conversation turn by turn; every reply, in order."""
    messages: list[dict[str, Any]] = []
    if plan.system is not None:
        messages.append({"role": "system", "content": plan.system})
    messages.append({"role": "user", "content": plan.first})
    replies = []
    for turn in range(plan.turns):
        body: dict[str, Any] = {
            "model": server.model,
            "messages": messages,
            "tools": TOOLS,
            "temperature": 0,
            "return_token_ids": True,
            "chat_template_kwargs": scripted.chat_kwargs(plan.script),
        }
        if plan.stop:
            body["stop"] = list(plan.stop)
        if plan.max_tokens is not None:
            body["max_tokens"] = plan.max_tokens
        reply = chat(server, body)
        replies.append(reply)
        message = _assistant(reply, plan, with_ids)
        if turn < plan.turns - 1:
            messages = [*messages, message, *_after(message, plan.follow_ups[turn])]
    return replies


def broken_turns(replies: list[dict[str, Any]]) -> list[int]:
    """The turns whose prompt does not begin with the previous prompt + output."""
    broken = []
    for turn in range(1, len(replies)):
        before = replies[turn - 1]
        kept = before["prompt_token_ids"] + before["choices"][0]["token_ids"]
        if replies[turn]["prompt_token_ids"][: len(kept)] != kept:
            broken.append(turn)
    return broken


def direct_greedy(reference: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding of the model in transformers on exactly these ids."""
    import torch

    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.fixture(scope="session")
def scripted_reference(scripted: ScriptedModel) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(scripted.path), dtype=torch.float32)
    return model.eval()


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(plan=plans())
def test_every_turn_starts_with_the_previous_prompt_and_output_few_examples(
    scripted_server: RunningServer,
    scripted: ScriptedModel,
    scripted_reference: Any,
    plan: Plan,
) -> None:
    replies = converse(scripted_server, scripted, plan, with_ids=True)
    assert broken_turns(replies) == []
    for turn, reply in enumerate(replies):
        prompt = reply["prompt_token_ids"]
        output = reply["choices"][0]["token_ids"]
        if turn:
            before = replies[turn - 1]
            reused = len(before["prompt_token_ids"]) + len(before["choices"][0]["token_ids"])
            assert reply["reused_prompt_tokens"] == reused
        else:
            assert "reused_prompt_tokens" not in reply
        # The server's greedy output is the model's on exactly those ids (a
        # stop string ends it early: then it is a prefix).
        assert output == direct_greedy(scripted_reference, prompt, len(output))
        if not plan.stop and plan.max_tokens is None:
            assert output == scripted.token_ids(plan.script)


@pytest.mark.parametrize("script", ["reasoning", "tool_call"])
def test_without_ids_the_template_breaks_the_invariant(
    scripted_server: RunningServer, scripted: ScriptedModel, script: str
) -> None:
    """The negative control: the same conversation re-rendered from text
    loses the past turn's ``<think>`` block, so its prompt does not begin
    with the previous prompt + output (what the property test would catch);
    with the ids it does."""
    plan = Plan(
        script=script, system=None, first="hi", turns=3, follow_ups=("next", None), synonym=False
    )
    rerendered = converse(scripted_server, scripted, plan, with_ids=False)
    assert broken_turns(rerendered) == [1, 2]
    think = scripted.piece_ids[script][0]  # the script opens with <think>
    assert think not in rerendered[1]["prompt_token_ids"]  # the past turn's was dropped
    assert broken_turns(converse(scripted_server, scripted, plan, with_ids=True)) == []


def test_openai_sdk_extra_body_carries_the_ids(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The rollout loop of docs/trainers.md: ids ride on the assistant
    message (the SDK passes unknown message keys through), the reply's ids
    come back through ``extra_body`` / ``model_extra``."""
    kwargs = scripted.chat_kwargs("tool_call")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    with openai.OpenAI(base_url=scripted_server.api_url, api_key="unused") as client:

        def create() -> Any:
            return client.chat.completions.create(
                model=scripted_server.model,
                messages=messages,
                tools=TOOLS,  # type: ignore[arg-type]
                temperature=0,
                extra_body={"return_token_ids": True, "chat_template_kwargs": kwargs},
            )

        first = create()
        prompt = (first.model_extra or {})["prompt_token_ids"]
        choice = first.choices[0]
        generated = (choice.model_extra or {})["token_ids"]
        (call,) = list(choice.message.tool_calls or [])
        messages += [
            {
                **choice.message.model_dump(exclude_none=True),
                "prompt_token_ids": prompt,
                "generation_token_ids": generated,
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ]
        second = create()
    extra = second.model_extra or {}
    assert extra["prompt_token_ids"][: len(prompt) + len(generated)] == prompt + generated
    assert extra["reused_prompt_tokens"] == len(prompt) + len(generated)


def test_tokenizer_info_reports_the_template_rewrites_history(
    scripted_server: RunningServer,
) -> None:
    info = httpx.get(scripted_server.base_url + "/tokenizer_info", timeout=30).json()
    assert info["prefix_preserving"] == {"user": False, "tool": False}


def _first_turn(server: RunningServer, scripted: ScriptedModel) -> tuple[list[Any], dict[str, Any]]:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    body = {
        "model": server.model,
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "return_token_ids": True,
        "chat_template_kwargs": scripted.chat_kwargs("tool_call"),
    }
    reply = chat(server, body)
    plan = Plan(
        script="tool_call", system=None, first="", turns=2, follow_ups=(None,), synonym=False
    )
    message = _assistant(reply, plan, with_ids=True)
    return [*messages, message, *_after(message, None)], body


def test_tokenize_previews_the_spliced_prompt(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    messages, body = _first_turn(scripted_server, scripted)
    preview = httpx.post(
        scripted_server.base_url + "/tokenize",
        json={
            "messages": messages,
            "tools": TOOLS,
            "chat_template_kwargs": body["chat_template_kwargs"],
        },
        timeout=60,
    ).json()
    reply = chat(scripted_server, {**body, "messages": messages})
    assert preview["tokens"] == reply["prompt_token_ids"]
    assert preview["reused_prompt_tokens"] == reply["reused_prompt_tokens"]


@pytest.mark.parametrize(
    ("index", "change", "param"),
    [
        (1, {"generation_token_ids": [10**9]}, "messages[1].generation_token_ids"),
        (1, {"prompt_token_ids": [1, 2, 3]}, "messages[1].prompt_token_ids"),
        (1, {"generation_token_ids": None}, "messages[1].generation_token_ids"),
        (0, {"prompt_token_ids": [1], "generation_token_ids": [2]}, "messages[0].prompt_token_ids"),
    ],
)
def test_bad_ids_are_a_400_naming_message_and_field(
    scripted_server: RunningServer,
    scripted: ScriptedModel,
    index: int,
    change: dict[str, Any],
    param: str,
) -> None:
    messages, body = _first_turn(scripted_server, scripted)
    messages[index] = {k: v for k, v in {**messages[index], **change}.items() if v is not None}
    for path, payload in (
        (CHAT, {**body, "messages": messages}),
        ("/tokenize", {"messages": messages, "tools": TOOLS}),
    ):
        response = httpx.post(scripted_server.base_url + path, json=payload, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert chat(scripted_server, body)["choices"][0]["token_ids"]  # others unaffected


def test_every_later_turn_reuses_the_cached_prefix(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """With prefix caching (issue G), the ids sent back are a cache hit: each
    turn after the first reports ``cached_tokens`` of at least the previous
    prompt + output, less its last generated id (never fed to the model)."""
    plan = Plan(
        script="tool_call", system="be brief", first="hi", turns=4,
        follow_ups=("next", None, "more"), synonym=True,
    )  # fmt: skip
    replies = converse(scripted_server, scripted, plan, with_ids=True)
    for before, reply in itertools.pairwise(replies):
        kept = len(before["prompt_token_ids"]) + len(before["choices"][0]["token_ids"])
        if scripted_server.engine == "vllm":
            # vLLM's prefix cache keeps whole KV blocks (128 tokens on its CPU
            # backend here; any block size that divides 128 passes too): the
            # reuse is the same prefix, cut down to a block boundary.
            kept = (kept - 1) // VLLM_BLOCK * VLLM_BLOCK + 1
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= kept - 1


def test_streamed_reply_reports_the_reused_ids_on_its_first_chunk(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    messages, body = _first_turn(scripted_server, scripted)
    whole = chat(scripted_server, {**body, "messages": messages})
    chunks = events(scripted_server, CHAT, {**body, "messages": messages})
    assert chunks[0]["reused_prompt_tokens"] == whole["reused_prompt_tokens"]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("reused_prompt_tokens" not in chunk for chunk in chunks[1:])
    assert streamed_ids(chunks) == whole["choices"][0]["token_ids"]
