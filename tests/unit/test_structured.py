"""The structured-output helper every surface calls: format fields to
constraints, and the constraint of a chat reply (format, tool calls, both),
with and without a grammar engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sluiceway.actors.constraints import ConstraintCompiler
from sluiceway.engines.base import EngineInfo
from sluiceway.engines.grammar import GrammarEngine
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.registry import ParserChoice, TextPathOptions, forced_tool_prefix
from sluiceway.protocol.constraints import Constraint, ConstraintKind, ReasoningGate
from sluiceway.protocol.errors import InvalidConstraint, InvalidRequest
from sluiceway.surfaces import structured
from sluiceway.surfaces.base import Job, Serving
from sluiceway.surfaces.conversation import (
    Conversation,
    Message,
    Role,
    StopOptions,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from sluiceway.surfaces.structured import OutputFormat, StructuredOutputs
from sluiceway.surfaces.tokens import generate

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    ("field", "kind", "text", "param"),
    [
        ({"json": SCHEMA}, ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA), "structured_outputs.json"),
        (
            {"json": json.dumps(SCHEMA, indent=2)},
            ConstraintKind.JSON_SCHEMA,
            json.dumps(SCHEMA),
            "structured_outputs.json",
        ),
        ({"regex": "[a-z]+"}, ConstraintKind.REGEX, "[a-z]+", "structured_outputs.regex"),
        ({"choice": ["a", "b"]}, ConstraintKind.CHOICE, '["a", "b"]', "structured_outputs.choice"),
        ({"grammar": 'start: "x"'}, ConstraintKind.GRAMMAR, 'start: "x"', "structured_outputs.grammar"),
        ({"json_object": True}, ConstraintKind.JSON_OBJECT, "", "structured_outputs.json_object"),
    ],
)  # fmt: skip
def test_structured_outputs_keep_vllms_names(
    field: dict[str, Any], kind: ConstraintKind, text: str, param: str
) -> None:
    output = structured.structured_outputs(StructuredOutputs.model_validate(field))
    assert output == OutputFormat(constraint=Constraint(kind=kind, text=text), param=param)


@pytest.mark.parametrize(
    "field", [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False}, {"choice": []}]
)
def test_structured_outputs_take_exactly_one_kind(field: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"exactly one|at least 1"):
        StructuredOutputs.model_validate(field)


def test_a_schema_keeps_its_key_order_and_must_be_an_object() -> None:
    output = structured.json_schema_format({"z": 1, "a": 2}, param="p")
    assert output.constraint.text == '{"z": 1, "a": 2}'
    for bad, message in (([1], "must be an object"), ("{nope", "not JSON")):
        with pytest.raises(InvalidConstraint, match=message) as caught:
            structured.json_schema_format(bad, param="text.format.schema")
        assert caught.value.param == "text.format.schema"


def test_one_format_per_request() -> None:
    a = structured.json_object_format(param="response_format")
    b = structured.json_schema_format({}, param="structured_outputs.json")
    assert structured.single_format(None, a, None) is a
    assert structured.single_format(None, None) is None
    with pytest.raises(
        InvalidRequest, match="either response_format or structured_outputs"
    ) as caught:
        structured.single_format(a, b)
    assert caught.value.param == "structured_outputs"


def test_a_reasoning_close_that_is_not_one_token_is_the_clients_400() -> None:
    serving: Any = SimpleNamespace(tokenizer=SimpleNamespace(single_token=lambda text: None))
    options = TextPathOptions(reasoning_parser="qwen3")
    output = structured.json_object_format(param="response_format")
    with pytest.raises(InvalidRequest, match="not one token") as caught:
        structured._after_reasoning(serving, options, output)
    assert caught.value.param == "response_format"


# --- a chat reply's constraint, on the default model's tokenizer ---------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(default_model: Path) -> tuple[ModelTokenizer, GrammarEngine]:
    tokenizer = ModelTokenizer(default_model, 1920)
    return tokenizer, GrammarEngine(tokenizer.hf, 1920, tokenizer.eos_ids)


def serving_of(tokenizer: ModelTokenizer, grammars: GrammarEngine | None) -> Serving:
    return Serving(
        model_name="m",
        created=0,
        engine=EngineInfo(
            name="x", device="cpu", dtype="float32", vocab_size=1920, max_context=4096
        ),
        tokenizer=tokenizer,
        parsers=ParserChoice("qwen3", "hermes"),
        max_num_seqs=4,
        max_top_logprobs=5,
        stop_in_reasoning=False,
        # Per test: its limiters belong to the test's event loop.
        constraints=ConstraintCompiler(grammars),
    )


@pytest.fixture
def with_grammar(model: tuple[ModelTokenizer, GrammarEngine]) -> Serving:
    return serving_of(*model)


@pytest.fixture
def without_grammar(model: tuple[ModelTokenizer, GrammarEngine]) -> Serving:
    return serving_of(model[0], None)


def conversation(*tools: ToolSpec, choice: ToolChoice | None = None) -> Conversation:
    return Conversation(
        messages=(Message(role=Role.USER, text="hi"),), tools=tools, tool_choice=choice
    )


REQUIRED = ToolChoice(mode=ToolChoiceMode.REQUIRED)
STRICT = ToolSpec(name="f", parameters=WEATHER, strict=True)
LOOSE = ToolSpec(name="g", parameters={"type": "object"})


@pytest.mark.anyio
async def test_free_replies_have_no_constraint(with_grammar: Serving) -> None:
    prompt = await structured.constrained_prompt(
        with_grammar, conversation(LOOSE), StopOptions(), None
    )
    assert prompt.constraint is None


@pytest.mark.anyio
async def test_a_format_waits_out_reasoning(with_grammar: Serving) -> None:
    output = structured.json_schema_format(WEATHER, param="response_format.json_schema.schema")
    prompt = await structured.constrained_prompt(
        with_grammar, conversation(), StopOptions(), output
    )
    assert prompt.constraint is not None
    assert prompt.constraint.key == output.constraint.key
    tokens = with_grammar.tokenizer
    assert prompt.constraint.reasoning == ReasoningGate(
        end_id=tokens.single_token("</think>") or -1, start_id=tokens.single_token("<think>")
    )


@pytest.mark.anyio
async def test_a_required_call_goes_through_the_grammar_not_the_prompt(
    with_grammar: Serving,
) -> None:
    free = await structured.constrained_prompt(
        with_grammar, conversation(STRICT, LOOSE), StopOptions(), None
    )
    forced = await structured.constrained_prompt(
        with_grammar, conversation(STRICT, LOOSE, choice=REQUIRED), StopOptions(), None
    )
    assert forced.ids == free.ids
    assert forced.options.forced_prefix == ""
    for prompt, required in ((free, False), (forced, True)):
        assert prompt.constraint is not None
        assert prompt.constraint.kind is ConstraintKind.GRAMMAR
        assert ("TEXT" in prompt.constraint.text) is not required


@pytest.mark.anyio
async def test_without_a_grammar_engine_a_required_call_is_forced_by_the_prompt(
    without_grammar: Serving,
) -> None:
    prompt = await structured.constrained_prompt(
        without_grammar, conversation(LOOSE, choice=REQUIRED), StopOptions(), None
    )
    assert prompt.constraint is None
    assert prompt.options.forced_prefix.endswith(forced_tool_prefix("hermes", None))
    with pytest.raises(InvalidConstraint, match="no grammar engine") as caught:
        await structured.constrained_prompt(
            without_grammar, conversation(LOOSE, STRICT), StopOptions(), None
        )
    assert caught.value.param == "tools[1].function.parameters"
    output = structured.json_object_format(param="response_format")
    with pytest.raises(InvalidConstraint, match="no grammar engine") as caught:
        await structured.constrained_prompt(without_grammar, conversation(), StopOptions(), output)
    assert caught.value.param == "response_format"


@pytest.mark.anyio
async def test_a_non_strict_schema_that_does_not_compile_leaves_any_arguments(
    with_grammar: Serving,
) -> None:
    odd = ToolSpec(name="odd", parameters={"type": "array", "uniqueItems": True})
    prompt = await structured.constrained_prompt(
        with_grammar, conversation(odd, choice=REQUIRED), StopOptions(), None
    )
    assert prompt.constraint is not None
    assert '"uniqueItems"' not in prompt.constraint.text
    strict = ToolSpec(name="odd", parameters={"type": "array", "uniqueItems": True}, strict=True)
    with pytest.raises(InvalidConstraint, match="uniqueItems") as caught:
        await structured.constrained_prompt(
            with_grammar, conversation(strict, choice=REQUIRED), StopOptions(), None
        )
    assert caught.value.param == "tools[0].function.parameters"


# --- the tokens endpoint: the field inside sampling_params ------------------------------------


class RecordingCall:
    """A streaming ``/inference/v1/generate`` exchange that keeps the jobs
    the handler submits instead of running them."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload
        self.jobs: list[Job] = []

    async def body(self) -> bytes:
        return json.dumps({**self.payload, "stream": True}).encode()

    async def stream(self, jobs: Sequence[Job], encoder: object) -> None:
        self.jobs.extend(jobs)


async def generate_constraint(serving: Serving, sampling: dict[str, Any]) -> Constraint | None:
    call = RecordingCall({"token_ids": [1, 2, 3], "sampling_params": sampling})
    await generate.handle(serving, call)  # type: ignore[arg-type]
    (job,) = call.jobs
    return job.request.constraint


@pytest.mark.anyio
async def test_generate_holds_its_ids_to_structured_outputs(with_grammar: Serving) -> None:
    assert await generate_constraint(with_grammar, {"max_tokens": 4}) is None
    constraint = await generate_constraint(
        with_grammar, {"structured_outputs": {"choice": ["a", "b"]}}
    )
    # No reasoning section to wait out: the ids are the format from the first.
    assert constraint == Constraint.choice(["a", "b"])
    assert constraint.reasoning is None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"regex": "(("}, "sampling_params.structured_outputs.regex"),
        ({"grammar": "start: nowhere"}, "sampling_params.structured_outputs.grammar"),
        ({"json": {"type": "array", "uniqueItems": True}}, "sampling_params.structured_outputs.json"),
        ({"regex": "a", "choice": ["a"]}, "sampling_params.structured_outputs"),
    ],
)  # fmt: skip
async def test_generate_names_the_bad_field_inside_sampling_params(
    with_grammar: Serving, field: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await generate_constraint(with_grammar, {"structured_outputs": field})
    assert caught.value.param == param


@pytest.mark.anyio
async def test_generate_without_a_grammar_engine_refuses_structured_outputs(
    without_grammar: Serving,
) -> None:
    with pytest.raises(InvalidConstraint, match="no grammar engine") as caught:
        await generate_constraint(without_grammar, {"structured_outputs": {"regex": "a"}})
    assert caught.value.param == "sampling_params.structured_outputs.regex"
