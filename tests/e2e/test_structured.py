"""Structured output end to end, on both engines under both worker classes:
``response_format`` and ``structured_outputs`` through the real server,
schemas from hypothesis against the random-weight default model (streamed
and whole), strict tools and forced tool choice through the grammar, the
reasoning model's free reasoning, errors that name their field, a schema
that takes too long to compile, and the clients that ask for structure (the
openai SDK's ``parse``, LangChain's ``with_structured_output``)."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.e2e import schemas as wire_schemas
from tests.e2e import test_tokens as tokens
from tests.e2e.conftest import DEFAULT_ENGINE_ONLY
from tests.e2e.harness import RunningServer, serving, sse_lines
from tests.fixtures.json_schemas import assert_valid, schemas
from tests.fixtures.scripted_model import ScriptedModel

MESSAGES = [{"role": "user", "content": "Describe the weather."}]
#: The default model is random: an open <think> would run to max_tokens.
NO_THINKING = {"enable_thinking": False}
MAX_TOKENS = 400

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict[str, Any], *, strict: bool | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.api_url}/{path}", json=body, timeout=120)


def chat(server: RunningServer, **fields: Any) -> dict[str, Any]:
    """A whole chat reply (checked against OpenAI's schema)."""
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **fields}
    response = post(server, "chat/completions", body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    wire_schemas.check(reply, wire_schemas.CHAT_COMPLETION)
    return reply


def chat_stream(server: RunningServer, **fields: Any) -> dict[str, Any]:
    """A streamed chat reply, put back together: content, reasoning, calls, finish."""
    body = {
        "model": server.model,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        **fields,
    }
    response = post(server, "chat/completions", body)
    assert response.status_code == 200, response.text
    merged: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for line in sse_lines(response.text):
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        wire_schemas.check(chunk, wire_schemas.CHAT_CHUNK)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            merged["content"] += delta.get("content") or ""
            merged["reasoning"] += delta.get("reasoning_content") or ""
            for fragment in delta.get("tool_calls") or ():
                call = merged["calls"].setdefault(fragment["index"], {"name": "", "arguments": ""})
                function = fragment.get("function") or {}
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            merged["finish"] = choice["finish_reason"] or merged["finish"]
    return merged


def whole_calls(reply: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = reply["choices"][0]["message"].get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed_calls(merged: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in merged["calls"].values()]


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


# --- formats against the random-weight default model ----------------------------


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_replies_validate_against_hypothesis_schemas_few_examples(
    server: RunningServer, schema: dict[str, Any], seed: int
) -> None:
    fields = {
        "response_format": response_format(schema),
        "temperature": 1.0,
        "seed": seed,
        "chat_template_kwargs": NO_THINKING,
    }
    reply = chat(server, **fields)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert_valid(json.loads(choice["message"]["content"]), schema)
    streamed = chat_stream(server, **fields)
    assert streamed["finish"] == "stop"
    # Seeded: the stream is the same document.
    assert streamed["content"] == choice["message"]["content"]


#: Regexes that Python's ``re`` reads as llguidance (Rust's regex crate) does.
PATTERNS = (
    r"[0-9]{1,4}",
    r"(yes|no|maybe)!?",
    r"[a-f]{2}-[0-9]{3}",
    r"[a-z0-9_]{1,5}@[a-z]{1,5}\.(com|org)",
    r"[A-Z][a-zé]{0,5}( [0-9]{2})?",
)
#: Choices of any printable text, multi-byte characters among them.
OPTIONS = st.lists(
    st.text(st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=8),
    min_size=1,
    max_size=5,
    unique=True,
)


def completion_texts(server: RunningServer, body: dict[str, Any]) -> tuple[str, str]:
    """The whole reply's text and the streamed one's, put back together."""
    reply = post(server, "completions", body).json()
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "stop", choice
    streamed = post(server, "completions", {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    pieces = [
        c["text"]
        for line in sse_lines(streamed.text)
        if line.startswith("data: {")
        for c in json.loads(line[6:])["choices"]
    ]
    return choice["text"], "".join(pieces)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=st.sampled_from(PATTERNS), options=OPTIONS, seed=st.integers(0, 2**16))
def test_replies_match_hypothesis_regexes_and_choices_few_examples(
    server: RunningServer, pattern: str, options: list[str], seed: int
) -> None:
    """Whole and streamed alike (seeded: the same text), on every engine."""
    for field in ({"regex": pattern}, {"choice": options}):
        body = {
            "model": server.model,
            "prompt": "Answer:",
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": seed,
            "structured_outputs": field,
        }
        whole, streamed = completion_texts(server, body)
        assert streamed == whole
        if "regex" in field:
            assert re.fullmatch(pattern, whole), whole
        else:
            assert whole in options


def test_json_object_is_an_object(server: RunningServer) -> None:
    """Whole and streamed alike (seeded: the same text); a reply that ends
    by itself is one JSON object, and at least one of them does."""
    fields = {"response_format": {"type": "json_object"}, "chat_template_kwargs": NO_THINKING}
    closed = 0
    for seed in JSON_OBJECT_SEEDS:
        whole = chat(server, temperature=0.8, seed=seed, **fields)["choices"][0]
        streamed = chat_stream(server, temperature=0.8, seed=seed, **fields)
        content = whole["message"]["content"]
        assert (streamed["content"], streamed["finish"]) == (content, whole["finish_reason"])
        if whole["finish_reason"] == "stop":
            closed += 1
            assert isinstance(json.loads(content), dict), content
        else:  # a random model may nest past max_tokens
            assert whole["finish_reason"] == "length"
            assert content.startswith("{")
    assert closed > 0, "no reply closed its object: the parse was never checked"


#: Seeds of the json_object test (a random model closes its object within
#: max_tokens for some seeds, not all).
JSON_OBJECT_SEEDS = (11, 12, 13, 14)

COMPLETION_FORMATS = [
    pytest.param({"regex": r"[0-9]{3}-[a-z]{2,4}"}, r"[0-9]{3}-[a-z]{2,4}", id="regex"),
    pytest.param({"choice": ["sunny", "rainy", "foggy"]}, r"sunny|rainy|foggy", id="choice"),
    pytest.param(
        {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'},
        r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)",
        id="grammar",
    ),
    pytest.param({"json": WEATHER}, None, id="json"),
    pytest.param({"json": json.dumps(WEATHER)}, None, id="json-text"),
]


@pytest.mark.parametrize(("field", "pattern"), COMPLETION_FORMATS)
def test_structured_outputs_on_completions(
    server: RunningServer, field: dict[str, Any], pattern: str | None
) -> None:
    body = {
        "model": server.model,
        "prompt": "Weather:",
        "max_tokens": 60,
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "structured_outputs": field,
    }
    reply = post(server, "completions", body).json()
    streamed = post(server, "completions", {**body, "stream": True})
    pieces: dict[int, str] = {0: "", 1: ""}
    for line in sse_lines(streamed.text):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                pieces[choice["index"]] += choice["text"]
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "stop", choice
        text = choice["text"]
        assert pieces[choice["index"]] == text
        if pattern is None:
            assert_valid(json.loads(text), WEATHER)
        else:
            assert re.fullmatch(pattern, text), text


def test_structured_outputs_on_chat(server: RunningServer) -> None:
    reply = chat(
        server,
        structured_outputs={"choice": ["yes", "no"]},
        chat_template_kwargs=NO_THINKING,
        temperature=1.0,
        seed=2,
    )
    assert reply["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize(("field", "pattern"), COMPLETION_FORMATS)
def test_structured_outputs_on_generate(
    server: RunningServer, field: dict[str, Any], pattern: str | None
) -> None:
    """On the tokens endpoint the field sits in ``sampling_params`` (vLLM's
    place) and holds the ids as completions holds its text: with the same
    prompt, format and seed, both sample the same ids."""
    prompt = tokens.post(server, "/tokenize", {"prompt": "Weather:"})["tokens"]
    params = {"max_tokens": 60, "n": 2, "temperature": 1.0, "seed": 5}
    completion = {
        "model": server.model,
        "prompt": prompt,
        "return_token_ids": True,
        "structured_outputs": field,
        **params,
    }
    texts = {
        c["index"]: (c["text"], c["token_ids"])
        for c in tokens.post(server, "/v1/completions", completion)["choices"]
    }
    body = {
        "model": server.model,
        "token_ids": prompt,
        "sampling_params": {**params, "structured_outputs": field},
    }
    whole = tokens.post(server, tokens.GENERATE, body)
    chunks = tokens.events(server, tokens.GENERATE, body)
    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        text, ids = texts[choice["index"]]
        assert choice["finish_reason"] == "stop", choice
        assert choice["token_ids"] == ids
        assert tokens.streamed_ids(chunks, choice["index"]) == ids
        if pattern is None:
            assert_valid(json.loads(text), WEATHER)
        else:
            assert re.fullmatch(pattern, text), text


# --- tools through the grammar ---------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_calls_of_strict_tools_have_valid_arguments(
    server: RunningServer, choice: Any
) -> None:
    # g's arguments are bounded too: sampled at temperature 1, an unbounded
    # object can run past max_tokens on whichever path the seed takes.
    bounded = {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 8}},
        "additionalProperties": False,
    }
    tools = [tool("f", WEATHER, strict=True), tool("g", bounded)]
    fields = {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 9,
        "chat_template_kwargs": NO_THINKING,
    }
    reply = chat(server, **fields)
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    ((name, arguments),) = whole_calls(reply)
    if isinstance(choice, dict):
        assert name == "f"
    if name == "f":
        assert_valid(arguments, WEATHER)
    streamed = chat_stream(server, **fields)
    assert streamed["finish"] == "tool_calls"
    assert streamed_calls(streamed) == [(name, arguments)]
    assert streamed["content"] == ""


# --- errors ------------------------------------------------------------------------------

#: ``structured_outputs`` values that are a 400, where in the field the error
#: points, a piece of its message, and a test id; each surface puts the field
#: in its own place.
BAD_STRUCTURED_OUTPUTS = [
    ({"regex": "(("}, ".regex", "unclosed group", "regex"),
    ({"grammar": "start: nowhere"}, ".grammar", "nowhere", "grammar"),
    ({"json": "{not json"}, ".json", "not JSON", "json-text"),
    ({"regex": "a", "choice": ["a"]}, "", "exactly one", "two-kinds"),
]

BAD_REQUESTS = [
    pytest.param(
        {"response_format": response_format({"type": "object", "properties": 3})},
        "response_format.json_schema.schema",
        "properties",
        id="schema",
    ),
    pytest.param(
        {"response_format": response_format({"type": "array", "uniqueItems": True})},
        "response_format.json_schema.schema",
        "uniqueItems",
        id="unimplemented-keyword",
    ),
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
        "",
        id="no-name",
    ),
    *(
        pytest.param({"structured_outputs": field}, f"structured_outputs{where}", message, id=name)
        for field, where, message, name in BAD_STRUCTURED_OUTPUTS
    ),
    pytest.param(
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "either",
        id="two-fields",
    ),
    pytest.param(
        {"tools": [tool("f", {"type": "object", "properties": {"x": {"format": "nope"}}}, strict=True)]},
        "tools[0].function.parameters",
        "nope",
        id="strict-tool",
    ),
    pytest.param(
        {"tools": [tool("f", WEATHER, strict=True)], "structured_outputs": {"grammar": 'start: "a"'}},
        "structured_outputs.grammar",
        "with tools",
        id="grammar-beside-tools",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "message"), BAD_REQUESTS)
def test_bad_formats_name_their_field(
    server: RunningServer, fields: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 5, **fields}
    response = post(server, "chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    wire_schemas.check(response.json(), wire_schemas.ERROR)
    assert error["param"] == param
    assert message in error["message"]


@pytest.mark.parametrize(
    ("field", "where", "message"),
    [pytest.param(*case[:3], id=case[3]) for case in BAD_STRUCTURED_OUTPUTS],
)
def test_bad_structured_outputs_on_generate_name_their_field(
    server: RunningServer, field: dict[str, Any], where: str, message: str
) -> None:
    body = {
        "model": server.model,
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 5, "structured_outputs": field},
    }
    response = httpx.post(server.base_url + tokens.GENERATE, json=body, timeout=120)
    assert response.status_code == 400, response.text
    wire_schemas.check(response.json(), wire_schemas.ERROR)
    error = response.json()["error"]
    assert error["param"] == f"sampling_params.structured_outputs{where}"
    assert message in error["message"]


# --- a schema too slow to compile ----------------------------------------------------------

#: Well under what the slow schema takes. At 0.5 s the test relied on a
#: loaded host: alone, llguidance 1.9 compiles that schema in ~0.3 s, and
#: the request was then served, not refused.
COMPILE_LIMIT = 0.1

#: ~0.35 MB: 400 alternatives of 20 required properties take llguidance
#: ~0.3 s to compile on the development host alone (much longer under load;
#: llguidance refuses schemas a few times larger outright).
SLOW_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(20)},
            "required": [f"k{i}_{j}" for j in range(20)],
        }
        for i in range(400)
    ]
}


@pytest.fixture(scope="module")
def limited_server(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with serving(
        default_model,
        tmp_path_factory.mktemp("logs"),
        "--grammar-compile-timeout",
        str(COMPILE_LIMIT),
        worker_class="trio",
    ) as running:
        yield running


@DEFAULT_ENGINE_ONLY
def test_a_slow_schema_is_refused_at_the_limit_while_streams_flow(
    limited_server: RunningServer,
) -> None:
    server = limited_server
    stamps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {
            "model": server.model,
            "messages": MESSAGES,
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", server.api_url + "/chat/completions", json=body) as reply,
        ):
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
                    started.set()

    flowing = threading.Thread(target=stream)
    flowing.start()
    assert started.wait(60)
    sent = time.monotonic()
    response = post(
        server,
        "chat/completions",
        {
            "model": server.model,
            "messages": MESSAGES,
            "response_format": response_format(SLOW_SCHEMA),
        },
    )
    answered = time.monotonic()
    flowing.join()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert f"did not compile within {COMPILE_LIMIT:g} s" in error["message"]
    assert answered - sent < COMPILE_LIMIT + 2.0
    # The stream went on while the schema compiled: no gap near the wait.
    during = [b - a for a, b in itertools.pairwise(stamps) if a >= sent - 1]
    assert during
    assert max(during) < 1.0, max(during)
    # The slow schema stays refused; others compile.
    again = post(
        server,
        "chat/completions",
        {
            "model": server.model,
            "messages": MESSAGES,
            "response_format": response_format(SLOW_SCHEMA),
        },
    )
    assert again.status_code == 400
    fine = chat(server, response_format=response_format(WEATHER), chat_template_kwargs=NO_THINKING)
    assert_valid(json.loads(fine["choices"][0]["message"]["content"]), WEATHER)


# --- the scripted model: reasoning stays free, tools are held to their schemas -------------

ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_reasoning_is_free_and_the_content_validates(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    fields = {
        "response_format": response_format(ANSWER),
        "chat_template_kwargs": scripted.chat_kwargs("json_after_reasoning"),
        "temperature": 0,
    }
    reply = chat(scripted_server, **fields)
    message = reply["choices"][0]["message"]
    # Not JSON, and not cut: the grammar waited for </think>.
    assert message["reasoning_content"] == "\nThey want JSON: {oops.\n"
    assert message["content"] == '{"answer": "yes"}'
    assert reply["choices"][0]["finish_reason"] == "stop"
    # The document's end ends the reply: no EOS after the script's last token.
    # vLLM (--engine vllm) lets its grammar, once complete, allow only EOS,
    # and the model then picks it: one token more, EOS, which writes no text.
    eos = 1 if scripted_server.engine == "vllm" else 0
    assert (
        reply["usage"]["completion_tokens"]
        == len(scripted.token_ids("json_after_reasoning")) - 1 + eos
    )
    streamed = chat_stream(scripted_server, **fields)
    assert (streamed["reasoning"], streamed["content"]) == (
        message["reasoning_content"],
        message["content"],
    )


WEATHER_TOOLS = [
    tool(
        "get_weather",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        strict=True,
    ),
    tool("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}}),
]


def test_a_strict_tools_arguments_are_held_to_its_schema(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    fields = {"chat_template_kwargs": scripted.chat_kwargs("strict_call"), "temperature": 0}
    reply = chat(scripted_server, tools=WEATHER_TOOLS, **fields)
    message = reply["choices"][0]["message"]
    assert message["content"] == "Let me check."
    # The script's "kelvin" was not allowed: the first unit the grammar allows.
    assert whole_calls(reply) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    streamed = chat_stream(scripted_server, tools=WEATHER_TOOLS, **fields)
    assert streamed["content"] == "Let me check."
    assert streamed_calls(streamed) == whole_calls(reply)
    # Not strict: the call is the script's.
    loose = [tool("get_weather", WEATHER_TOOLS[0]["function"]["parameters"]), WEATHER_TOOLS[1]]
    free = chat(scripted_server, tools=loose, **fields)
    assert whole_calls(free) == [("get_weather", {"city": "Paris", "unit": "kelvin"})]


def test_forced_tool_choice_goes_through_the_grammar_not_the_prompt(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """With a grammar engine, ``required`` adds nothing to the prompt."""
    fields = {"chat_template_kwargs": scripted.chat_kwargs("required"), "tools": WEATHER_TOOLS}
    forced = chat(scripted_server, tool_choice="required", **fields)
    offered = chat(scripted_server, tool_choice="auto", **fields)
    assert forced["usage"]["prompt_tokens"] == offered["usage"]["prompt_tokens"]
    assert whole_calls(forced) == [("get_time", {"tz": "UTC"})]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("asyncio", "mlx"), id="asyncio-mlx"),
        pytest.param(("trio", "transformers"), id="trio-transformers"),
    ],
)
def coder_server(
    request: pytest.FixtureRequest,
    scripted: ScriptedModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    worker_class, engine = request.param
    with serving(
        scripted.path,
        tmp_path_factory.mktemp("logs"),
        "--tool-call-parser",
        "qwen3_coder",
        "--engine",
        engine,
        worker_class=worker_class,
    ) as running:
        yield running


@DEFAULT_ENGINE_ONLY
def test_a_strict_tool_in_the_xml_form(
    coder_server: RunningServer, scripted: ScriptedModel
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    fields = {
        "tools": [tool("get_weather", schema, strict=True)],
        "chat_template_kwargs": scripted.chat_kwargs("coder_call"),
        "temperature": 0,
    }
    reply = chat(coder_server, **fields)
    # "three" was not allowed: the smallest integer the schema allows.
    assert whole_calls(reply) == [("get_weather", {"city": "Oslo", "days": 1})]
    streamed = chat_stream(coder_server, **fields)
    assert streamed_calls(streamed) == whole_calls(reply)


# --- clients that ask for structure -------------------------------------------------------


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    temperature: int = Field(ge=-40, le=50)
    unit: Literal["c", "f"]
    windy: bool


def test_openai_sdk_parse(server: RunningServer) -> None:
    with openai.OpenAI(base_url=server.api_url, api_key="unused") as client:
        parsed = client.chat.completions.parse(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=Forecast,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=4,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        beta = client.beta.chat.completions.parse(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=Forecast,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=4,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        with client.chat.completions.stream(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=Forecast,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=4,
            extra_body={"chat_template_kwargs": NO_THINKING},
        ) as stream:
            final = stream.get_final_completion()
        called = client.chat.completions.parse(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=[openai.pydantic_function_tool(Forecast)],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=4,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
    forecast = parsed.choices[0].message.parsed
    assert isinstance(forecast, Forecast)
    assert beta.choices[0].message.parsed == forecast
    assert final.choices[0].message.parsed == forecast
    (call,) = called.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Forecast)  # type: ignore[union-attr]


def test_langchain_with_structured_output(server: RunningServer) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=server.model,
        base_url=server.api_url,
        api_key="unused",  # type: ignore[arg-type]
        temperature=0.7,
        seed=4,
        max_completion_tokens=MAX_TOKENS,
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    structured = model.with_structured_output(Forecast, method="json_schema")
    forecast = structured.invoke("Describe the weather.")
    assert isinstance(forecast, Forecast)
