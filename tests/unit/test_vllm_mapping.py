"""The vLLM mapping (``sluiceway.engines.vllm_engine``), without vLLM: every
request field mapped to ``SamplingParams`` or refused by name, the grammar
handed to vLLM's ``guidance`` backend accepting what ours accepts, and vLLM's
outputs read back as our token events. vLLM's output objects are stood in
for by dataclasses of the same field names (``vllm.outputs.CompletionOutput``,
``vllm.logprobs.Logprob``); ``make test-vllm`` runs the real ones."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.engines.grammar import GrammarEngine, grammar_text
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.engines.vllm_engine import (
    MAX_LOGPROB_TOKEN_IDS,
    VllmOptions,
    engine_args,
    engine_prompt,
    finish_cause,
    lark_grammar,
    parse_extra_args,
    prompt_scores,
    rename_start,
    sampling_fields,
    token_samples,
    worker_threads,
)
from sluiceway.protocol.constraints import Constraint, ConstraintKind, ReasoningGate
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import (
    FinishCause,
    GenerationRequest,
    Limits,
    LogprobParams,
    SamplingParams,
    TokenLogprob,
)
from sluiceway.server.cli import main
from sluiceway.server.config import CHOICES, ServerConfig

EOS = frozenset({0, 2})


def request(**changes: Any) -> GenerationRequest:
    base = GenerationRequest(
        request_id="r",
        prompt_ids=(5, 6, 7),
        limits=Limits(max_tokens=9, min_tokens=2, stop_token_ids=frozenset({11})),
    )
    return replace(base, **changes)


@dataclass(frozen=True)
class Logprob:
    """``vllm.logprobs.Logprob``'s fields."""

    logprob: float
    rank: int | None = None


@dataclass(frozen=True)
class Completion:
    """``vllm.outputs.CompletionOutput``'s fields that the mapping reads."""

    token_ids: tuple[int, ...]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None


# --- requests -----------------------------------------------------------------


def test_every_sampling_field_is_mapped() -> None:
    sampling = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias=((3, 1.5), (4, -2.0)),
    )
    fields = sampling_fields(request(sampling=sampling, n=3), 0, eos_ids=EOS)
    assert fields == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "logit_bias": {3: 1.5, 4: -2.0},
        "max_tokens": 9,
        "min_tokens": 2,
        "stop_token_ids": [0, 2, 11],
        "ignore_eos": True,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def test_each_choice_is_seeded_apart() -> None:
    seeded = request(n=3, sampling=SamplingParams(seed=2**63 - 1))
    seeds = [sampling_fields(seeded, c, eos_ids=EOS)["seed"] for c in range(3)]
    assert seeds == [2**63 - 1, 0, 1]
    assert sampling_fields(request(), 1, eos_ids=EOS)["seed"] is None


def test_ignore_eos_leaves_eos_out_of_the_stop_ids() -> None:
    limits = Limits(max_tokens=4, stop_token_ids=frozenset({11}), ignore_eos=True)
    assert sampling_fields(request(limits=limits), 0, eos_ids=EOS)["stop_token_ids"] == [11]


def test_logprob_options() -> None:
    top = sampling_fields(request(logprobs=LogprobParams(top=3, prompt_top=1)), 0, eos_ids=EOS)
    assert (top["logprobs"], top["prompt_logprobs"]) == (3, 1)
    # The prompt is scored once, by the first choice's vLLM request.
    later = sampling_fields(request(logprobs=LogprobParams(top=3, prompt_top=1)), 1, eos_ids=EOS)
    assert "prompt_logprobs" not in later
    ids = sampling_fields(request(logprobs=LogprobParams(top=0, token_ids=(4, 9))), 0, eos_ids=EOS)
    assert ids["logprob_token_ids"] == [4, 9]
    assert "logprobs" not in ids
    assert "logprobs" not in sampling_fields(request(), 0, eos_ids=EOS)


@pytest.mark.parametrize(
    ("changes", "mode", "param"),
    [
        ({"logprobs": LogprobParams(top=2, token_ids=(4,))}, "raw", "logprob_token_ids"),
        (
            {"logprobs": LogprobParams(top=0, token_ids=tuple(range(MAX_LOGPROB_TOKEN_IDS + 1)))},
            "raw",
            "logprob_token_ids",
        ),
        (
            {
                "logprobs": LogprobParams(top=0),
                "constraint": Constraint(kind=ConstraintKind.JSON_OBJECT),
            },
            "raw",
            "logprobs",
        ),
    ],
)
def test_what_vllm_cannot_honour_is_refused_by_name(
    changes: dict[str, Any], mode: str, param: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        sampling_fields(request(**changes), 0, eos_ids=EOS, logprobs_mode=mode)
    assert refused.value.param == param


def test_structured_logprobs_are_served_as_processed() -> None:
    constrained = request(
        logprobs=LogprobParams(top=1), constraint=Constraint(kind=ConstraintKind.JSON_OBJECT)
    )
    fields = sampling_fields(
        constrained, 0, eos_ids=EOS, logprobs_mode="processed", grammar="start: body"
    )
    assert fields["structured_outputs"] == {"grammar": "start: body"}


# --- grammars -----------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(default_model: Path) -> GrammarEngine:
    config = json.loads((default_model / "config.json").read_text())
    tokenizer = ModelTokenizer(default_model, int(config["vocab_size"]))
    return GrammarEngine(tokenizer.hf, int(config["vocab_size"]), tokenizer.eos_ids)


def _accepts(grammars: GrammarEngine, grammar: str, ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


def _vllm_grammar(constraint: Constraint) -> str:
    # What vLLM's guidance backend does with a ``grammar`` structured output.
    return str(llguidance.grammar_from("grammar", lark_grammar(constraint)))


CONSTRAINTS = [
    Constraint(
        kind=ConstraintKind.JSON_SCHEMA,
        text=json.dumps(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        ),
    ),
    Constraint(kind=ConstraintKind.JSON_OBJECT),
    Constraint(kind=ConstraintKind.REGEX, text=r"[a-c]{1,3}-\d+"),
    Constraint.choice(["yes", "no", "maybe so"]),
    Constraint(kind=ConstraintKind.GRAMMAR, text='start: "x" ("y" | "z")*'),
]
TEXTS = [
    '{"a": 1}',
    '{"a": 1, "b": "q"}',
    '{"a":1}',
    '{"b": "q"}',
    "{}",
    "ab-12",
    "abcd-1",
    "yes",
    "maybe so",
    "maybe",
    "xyzzy",
    "xyz",
    "",
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind.value)
@pytest.mark.parametrize("text", TEXTS)
def test_vllms_grammar_accepts_what_ours_accepts(
    grammars: GrammarEngine, constraint: Constraint, text: str
) -> None:
    ids = grammars_ids(grammars, text)
    ours = _accepts(grammars, grammar_text(constraint), ids)
    assert _accepts(grammars, _vllm_grammar(constraint), ids) == ours


def grammars_ids(grammars: GrammarEngine, text: str) -> list[int]:
    return list(grammars.tokenizer.tokenize_str(text))


# Grammar compiles take milliseconds, and more on a busy host: no deadline.
@settings(deadline=None, max_examples=60)
@given(text=st.text(alphabet="abcyesnomx-0123456789 ", max_size=8))
def test_regex_and_choice_agree_on_any_text(grammars: GrammarEngine, text: str) -> None:
    ids = grammars_ids(grammars, text)
    for constraint in CONSTRAINTS[2:]:
        ours = _accepts(grammars, grammar_text(constraint), ids)
        assert _accepts(grammars, _vllm_grammar(constraint), ids) == ours, constraint


def test_the_reasoning_gate_goes_in_front(grammars: GrammarEngine) -> None:
    think, end = 1878, 1879  # <think>, </think> of the default model
    answer = grammars_ids(grammars, "yes")
    musing = grammars_ids(grammars, "hello world")
    opening = Constraint.choice(["yes"], reasoning=ReasoningGate(end_id=end, start_id=think))
    grammar = _vllm_grammar(opening)
    assert _accepts(grammars, grammar, [think, *musing, end, *answer])
    assert _accepts(grammars, grammar, answer)
    assert not _accepts(grammars, grammar, [*musing, end, *answer])
    inside = Constraint.choice(["yes"], reasoning=ReasoningGate(end_id=end, inside=True))
    assert _accepts(grammars, _vllm_grammar(inside), [*musing, end, *answer])
    assert not _accepts(grammars, _vllm_grammar(inside), answer)


#: A Lark grammar whose start rule recurs, and "start" in a literal, a
#: regex and a comment, which stay.
RECURSIVE = 'start: "a" start | "b" tail\ntail: "start" | /start?x/ // start\n'


@pytest.mark.parametrize("text", ["b", "ab", "aab", "abstart", "abstarx", "a", "bx", "start"])
def test_a_lark_grammar_goes_behind_the_gate_too(grammars: GrammarEngine, text: str) -> None:
    think, end = 1878, 1879
    plain = Constraint(kind=ConstraintKind.GRAMMAR, text=RECURSIVE)
    gated = replace(plain, reasoning=ReasoningGate(end_id=end, start_id=think))
    ids = grammars_ids(grammars, text)
    ours = _accepts(grammars, grammar_text(plain), ids)
    musing = [think, *grammars_ids(grammars, "hmm"), end]
    assert _accepts(grammars, _vllm_grammar(gated), [*musing, *ids]) == ours
    assert _accepts(grammars, _vllm_grammar(gated), ids) == ours


def test_only_the_start_identifier_is_renamed() -> None:
    assert rename_start(RECURSIVE) == (
        'sluiceway_body: "a" sluiceway_body | "b" tail\ntail: "start" | /start?x/ // start\n'
    )
    assert rename_start('start: "\\"start" restart start_') == (
        'sluiceway_body: "\\"start" restart start_'
    )


# --- outputs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "reason", "changes", "cause"),
    [
        (2, None, {}, None),
        (2, "stop", {}, FinishCause.EOS),
        (11, "stop", {}, FinishCause.STOP_TOKEN),
        (5, "length", {}, FinishCause.MAX_TOKENS),
        # EOS comes before a stop token, and both before max_tokens.
        (2, "length", {}, FinishCause.EOS),
        (5, "abort", {}, None),
        (
            5,
            "stop",
            {"constraint": Constraint(kind=ConstraintKind.JSON_OBJECT)},
            FinishCause.GRAMMAR,
        ),
        (
            2,
            "length",
            {"limits": Limits(max_tokens=1, ignore_eos=True)},
            FinishCause.MAX_TOKENS,
        ),
    ],
)
def test_finish_causes(
    token: int, reason: str | None, changes: dict[str, Any], cause: FinishCause | None
) -> None:
    assert finish_cause(token, reason, eos_ids=EOS, request=request(**changes)) is cause


def test_a_delta_becomes_samples_with_their_entries() -> None:
    asked = request(logprobs=LogprobParams(top=2))
    positions = [
        # The sampled token inside the top 2, then outside it (vLLM adds it).
        {7: Logprob(-0.5, 1), 8: Logprob(-1.5, 2)},
        {9: Logprob(-3.0, 5), 7: Logprob(-0.2, 1), 8: Logprob(-2.0, 2)},
    ]
    samples = token_samples(
        Completion((7, 9), positions, finish_reason="length"), 1, asked, eos_ids=EOS
    )
    assert [(s.choice, s.token_id, s.finish) for s in samples] == [
        (1, 7, None),
        (1, 9, FinishCause.MAX_TOKENS),
    ]
    assert samples[0].logprob == TokenLogprob(-0.5, ((7, -0.5), (8, -1.5)))
    assert samples[1].logprob == TokenLogprob(-3.0, ((7, -0.2), (8, -2.0)))


def test_named_ids_come_back_as_requested_entries() -> None:
    asked = request(logprobs=LogprobParams(top=0, token_ids=(4, 3)))
    position = {7: Logprob(-0.1, 1), 3: Logprob(-4.0, 9), 4: Logprob(-5.0, 12)}
    (sample,) = token_samples(Completion((7,), [position]), 0, asked, eos_ids=EOS)
    assert sample.logprob == TokenLogprob(-0.1, (), ((4, -5.0), (3, -4.0)))


def test_no_logprobs_asked_means_no_entries() -> None:
    (sample,) = token_samples(Completion((7,), None), 0, request(), eos_ids=EOS)
    assert sample.logprob is None


def test_the_prompt_goes_as_rendered_token_input() -> None:
    """vLLM takes a typed token input as it is; a bare dict of ids would be a
    raw prompt, rendered on its thread pool first."""
    prompt = engine_prompt((5, 6, 7))
    assert prompt == {"type": "token", "prompt_token_ids": [5, 6, 7]}
    assert isinstance(prompt["prompt_token_ids"], list)


def test_prompt_logprobs() -> None:
    positions = [None, {6: Logprob(-1.0, 3), 1: Logprob(-0.5, 1)}, {7: Logprob(-0.3, 1)}]
    scores = prompt_scores(positions, (5, 6, 7), 1)
    assert scores.entries == (
        None,
        TokenLogprob(-1.0, ((1, -0.5),), rank=3),
        TokenLogprob(-0.3, ((7, -0.3),), rank=1),
    )


# --- flags --------------------------------------------------------------------


def test_engine_arguments() -> None:
    options = VllmOptions(
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        gpu_memory_utilization=0.8,
        max_model_len=4096,
        enforce_eager=True,
        quantization="awq",
        extra={"kv_cache_dtype": "fp8"},
    )
    args = engine_args(
        "/m",
        options,
        dtype="float32",
        max_num_seqs=8,
        max_top_logprobs=20,
        logprobs_mode="processed",
        prefix_cache=False,
    )
    assert args["model"] == "/m"
    assert args["tensor_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "ray"
    assert (args["gpu_memory_utilization"], args["max_model_len"]) == (0.8, 4096)
    assert (args["enforce_eager"], args["quantization"]) == (True, "awq")
    assert args["kv_cache_dtype"] == "fp8"
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["enable_prefix_caching"] is False
    assert args["structured_outputs_config"] == {"backend": "guidance"}
    plain = engine_args(
        "/m",
        VllmOptions(),
        dtype="auto",
        max_num_seqs=8,
        max_top_logprobs=20,
        logprobs_mode="raw",
        prefix_cache=True,
    )
    assert "distributed_executor_backend" not in plain
    assert "max_model_len" not in plain


NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.mark.parametrize(
    ("environ", "cpus", "workers", "requested", "expected"),
    [
        (NOBIND, 2, 1, 0, 1),  # this host: one core stays free for the other processes
        (NOBIND, 16, 1, 0, 15),
        (NOBIND, 16, 2, 0, 7),  # tensor parallel: one core each kept, the rest shared
        (NOBIND, 2, 2, 0, 1),  # never fewer than one
        (NOBIND, 1, 1, 0, 1),
        (NOBIND, 2, 1, 3, 3),  # --engine-threads
        ({**NOBIND, "OMP_NUM_THREADS": "2"}, 8, 1, 0, 2),  # the environment's own count
        ({**NOBIND, "OMP_NUM_THREADS": "2"}, 8, 1, 4, 4),  # the flag before it
        ({**NOBIND, "OMP_NUM_THREADS": "x"}, 8, 1, 0, None),  # left to torch to read
        ({}, 2, 1, 0, None),  # vLLM's own binding (auto) sizes its threads
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, 2, 1, 3, None),
    ],
)
def test_vllms_cpu_workers_leave_a_core_to_the_other_processes(
    environ: dict[str, str], cpus: int, workers: int, requested: int, expected: int | None
) -> None:
    found = worker_threads(environ, cpus=cpus, workers=workers, requested=requested, on_cpu=True)
    assert found == expected


def test_a_gpus_workers_size_their_own_threads() -> None:
    assert worker_threads(NOBIND, cpus=8, workers=1, requested=2, on_cpu=False) is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"max_num_seqs": 4}', "max_num_seqs"),
        ('{"model": "x"}', "model"),
    ],
)
def test_extra_engine_arguments_are_checked(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_extra_args(text)


def test_the_flags_reach_the_options() -> None:
    config = ServerConfig(
        engine="vllm",
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        data_parallel_size=3,
        max_model_len=2048,
        vllm_engine_args='{"swap_space": 1}',
    )
    options = config.vllm_options()
    assert (options.tensor_parallel_size, options.pipeline_parallel_size) == (4, 2)
    assert options.data_parallel_size == 3
    assert options.max_model_len == 2048
    assert options.gpu_memory_utilization is None
    assert dict(options.extra) == {"swap_space": 1}


def test_vllm_is_refused_on_trio() -> None:
    with pytest.raises(ValueError, match="asyncio"):
        ServerConfig(engine="vllm", worker_class="trio")


def test_docs_list_the_vllm_flags_with_their_choices() -> None:
    """docs/cli.md has a row for each vLLM flag, spelling its choices as the CLI does."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    rows = {line.split("`")[1].split()[0]: line for line in text.splitlines() if line[:3] == "| `"}
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "distributed_executor_backend",
        "gpu_memory_utilization",
        "max_model_len",
        "enforce_eager",
        "quantization",
        "vllm_engine_args",
        "engine",
        "dtype",
    ):
        flag = "--" + name.replace("_", "-")
        assert flag in rows, flag
        assert f"SLUICEWAY_{name.upper()}" in rows[flag]
        if name in CHOICES:
            assert "\\|".join(CHOICES[name]) in rows[flag], flag


def test_an_unsafe_pairing_stops_the_cli() -> None:
    assert main(["serve", "--engine", "vllm", "--worker-class", "trio"]) == 2
    assert main(["serve", "--engine", "vllm", "--vllm-engine-args", '{"model": "x"}']) == 2
