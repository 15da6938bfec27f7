"""The grammar engine (llguidance): token tables from our tokenizers, compiling
each kind of constraint, errors, the cache and the time limit, and the
async compiler that surfaces call."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from sluiceway.actors.constraints import ConstraintCompiler
from sluiceway.engines.default_model import chat_template, train_tokenizer, write_tokenizer
from sluiceway.engines.grammar import GrammarConfig, GrammarEngine, GrammarError, allowed_ids
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.errors import InvalidConstraint
from tests.fixtures.scripted_model import ScriptedModel

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
    "required": ["name"],
    "additionalProperties": False,
}


def json_schema(schema: object) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(schema))


@pytest.fixture(scope="module")
def default_tokenizer(default_model: Path) -> ModelTokenizer:
    config = json.loads((default_model / "config.json").read_text())
    return ModelTokenizer(default_model, int(config["vocab_size"]))


@pytest.fixture(scope="module")
def grammars(default_tokenizer: ModelTokenizer) -> GrammarEngine:
    return GrammarEngine(default_tokenizer.hf, 1920, default_tokenizer.eos_ids)


def _tokenizers(
    default_model: Path, scripted: ScriptedModel, tmp: Path
) -> Iterator[ModelTokenizer]:
    yield ModelTokenizer(default_model, 1920)
    yield ModelTokenizer(scripted.path, 2048)
    small = tmp / "small"
    write_tokenizer(small, train_tokenizer(vocab_size=512), chat_template())
    yield ModelTokenizer(small, 576)


def test_token_tables_from_our_tokenizers_match_ours(
    default_model: Path, scripted: ScriptedModel, tmp_path: Path
) -> None:
    """llguidance reads each byte-level BPE tokenizer to the same bytes per
    id as our detokenizer; special and padding ids (empty in ours) are
    special tokens there, which no grammar of text reaches. Byte 0xFF,
    which no UTF-8 text holds, is llguidance's marker of special tokens: the
    token of that byte alone reads as empty there, and no grammar reaches it."""
    for tokenizer in _tokenizers(default_model, scripted, tmp_path):
        vocab = len(tokenizer.table.raw_bytes) + 7
        engine = GrammarEngine(tokenizer.hf, vocab, tokenizer.eos_ids)
        assert engine.mask_words == (vocab + 31) // 32
        table = engine.tokenizer
        assert table.vocab_size == vocab
        for token, data in enumerate(tokenizer.table.raw_bytes):
            if token in tokenizer.table.hidden or not data:
                assert table.is_special_token(token), token
            elif data == b"\xff":
                assert table.decode_bytes([token]) == b""
            else:
                assert table.decode_bytes([token]) == data, token


def test_a_document_tokenized_by_the_model_walks_through_its_grammar(
    grammars: GrammarEngine, default_tokenizer: ModelTokenizer
) -> None:
    matcher = grammars.compile(json_schema(SCHEMA)).matcher()
    document = '{"name": "ab", "n": -12}'
    masks = grammars.new_masks(1)
    eos = min(grammars.eos_ids)
    for token in default_tokenizer.encode(document):
        grammars.fill_masks([matcher], masks)
        allowed = allowed_ids(masks[0], grammars.vocab_size)
        assert allowed[token]
        assert not allowed[eos], "EOS only where the grammar accepts"
        assert matcher.consume_token(token)
    assert matcher.is_accepting()
    assert matcher.is_stopped()  # a closed object admits nothing more


@pytest.mark.parametrize(
    ("constraint", "accepted", "rejected"),
    [
        (Constraint(kind=ConstraintKind.JSON_OBJECT), '{"x": [1, null]}', "[1]"),
        (Constraint(kind=ConstraintKind.REGEX, text=r"[0-9]{3}-[a-z]+"), "123-ab", "12-ab"),
        (Constraint.choice(["yes", 'n"o', "ü"]), 'n"o', "maybe"),
        (Constraint(kind=ConstraintKind.GRAMMAR, text='start: "a" "b"*'), "abbb", "ba"),
    ],
)
def test_each_kind_compiles_to_its_language(
    grammars: GrammarEngine,
    default_tokenizer: ModelTokenizer,
    constraint: Constraint,
    accepted: str,
    rejected: str,
) -> None:
    grammar = grammars.compile(constraint)
    good = grammar.matcher()
    assert good.consume_tokens(default_tokenizer.encode(accepted))
    assert good.is_accepting()
    bad = grammar.matcher()
    consumed = bad.try_consume_tokens(default_tokenizer.encode(rejected))
    assert consumed < len(default_tokenizer.encode(rejected)) or not bad.is_accepting()


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (json_schema({"type": "object", "properties": 3}), "properties"),
        (Constraint(kind=ConstraintKind.JSON_SCHEMA, text="{not json"), "line 1 column 2"),
        (json_schema({"type": "string", "pattern": "(("}), "unclosed group"),
        (Constraint(kind=ConstraintKind.REGEX, text="a(b"), "unclosed group"),
        (Constraint(kind=ConstraintKind.GRAMMAR, text="start: undefined_rule"), "unknown name"),
        (Constraint(kind=ConstraintKind.CHOICE, text="[]"), "non-empty"),
        (Constraint(kind=ConstraintKind.CHOICE, text="[1]"), "string"),
    ],
)
def test_what_does_not_compile_fails_with_the_engines_message(
    grammars: GrammarEngine, constraint: Constraint, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        grammars.compile(constraint)
    with pytest.raises(GrammarError, match=message):  # cached, failing the same way
        grammars.compile(constraint)


def test_compiled_grammars_are_cached_by_kind_and_text(
    default_tokenizer: ModelTokenizer,
) -> None:
    engine = GrammarEngine(
        default_tokenizer.hf, 1920, default_tokenizer.eos_ids, GrammarConfig(cache_size=2)
    )
    first = engine.compile(json_schema(SCHEMA))
    assert engine.compile(json_schema(SCHEMA)) is first
    # Same text, another kind: another grammar (a class of two characters, one string).
    regex = engine.compile(Constraint(kind=ConstraintKind.REGEX, text='["a"]'))
    choice = engine.compile(Constraint.choice(["a"]))
    assert regex is not choice
    assert engine.compile(Constraint.choice(["a"])) is choice
    # The cache holds two: the schema went first.
    assert engine.compile(json_schema(SCHEMA)) is not first
    # Matchers are copies: one advancing leaves the other where it was.
    one, two = first.matcher(), first.matcher()
    assert one.consume_tokens(default_tokenizer.encode('{"name": "ab", "n'))
    assert two.consume_tokens(default_tokenizer.encode('{"name": "x"}'))
    assert two.is_stopped()
    assert not one.is_stopped()


def test_concurrent_compiles_of_one_constraint_compile_once(
    default_tokenizer: ModelTokenizer,
) -> None:
    engine = GrammarEngine(default_tokenizer.hf, 1920, default_tokenizer.eos_ids)
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda: results.append(engine.compile(json_schema(SCHEMA))))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    assert len({id(result) for result in results}) == 1


def test_a_compile_over_the_time_limit_fails_and_stays_failed(
    default_tokenizer: ModelTokenizer,
) -> None:
    slow = GrammarEngine(
        default_tokenizer.hf,
        1920,
        default_tokenizer.eos_ids,
        GrammarConfig(compile_seconds=1e-9),
    )
    with pytest.raises(GrammarError, match="over the limit"):
        slow.compile(json_schema(SCHEMA))
    with pytest.raises(GrammarError, match="over the limit"):
        slow.compile(json_schema(SCHEMA))


@pytest.mark.anyio
async def test_the_compiler_turns_engine_errors_into_client_errors(
    grammars: GrammarEngine,
) -> None:
    compiler = ConstraintCompiler(grammars)
    await compiler.check(json_schema(SCHEMA), param="response_format")
    with pytest.raises(InvalidConstraint, match=r"(?s)invalid regex: .*unclosed group") as caught:
        await compiler.check(
            Constraint(kind=ConstraintKind.REGEX, text="(("), param="structured_outputs.regex"
        )
    assert caught.value.param == "structured_outputs.regex"
    assert caught.value.status == 400
    with pytest.raises(InvalidConstraint, match="no grammar engine"):
        await ConstraintCompiler(None).check(json_schema(SCHEMA), param="p")


@pytest.mark.anyio
async def test_a_compile_that_hangs_gets_its_client_error_at_the_time_limit(
    grammars: GrammarEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client is answered at the limit even if the compile never ends
    (llguidance's own limits end it; here it is held until the test is done)."""
    release = threading.Event()
    engine = GrammarEngine.__new__(GrammarEngine)
    engine.config = GrammarConfig(compile_seconds=0.2)

    def stuck(constraint: Constraint) -> None:
        release.wait(10)

    monkeypatch.setattr(engine, "compile", stuck, raising=False)
    compiler = ConstraintCompiler(engine)
    started = anyio.current_time()
    try:
        with pytest.raises(InvalidConstraint, match=r"did not compile within 0\.2 s"):
            await compiler.check(json_schema(SCHEMA), param="response_format")
        assert anyio.current_time() - started < 2
    finally:
        release.set()


def test_masks_allow_eos_exactly_where_the_grammar_accepts(
    grammars: GrammarEngine, default_tokenizer: ModelTokenizer
) -> None:
    matcher = grammars.compile(Constraint(kind=ConstraintKind.REGEX, text="[0-9]{1,3}")).matcher()
    masks = grammars.new_masks(1)
    accepting = []
    for token in [*default_tokenizer.encode("1"), *default_tokenizer.encode("2")]:
        grammars.fill_masks([matcher], masks)
        accepting.append(bool(allowed_ids(masks[0], 1920)[list(grammars.eos_ids)].all()))
        assert matcher.consume_token(token)
    grammars.fill_masks([matcher], masks)
    accepting.append(bool(allowed_ids(masks[0], 1920)[list(grammars.eos_ids)].all()))
    assert accepting == [False, True, True]
    assert np.count_nonzero(masks[0]) > 0
