"""The scripted-model fixture: both engines must decode each script exactly.

The model is loaded the way the server loads any model (``resolve_model``,
``ModelTokenizer``, ``MlxEngine``) and by plain transformers ``generate``; the
prompt is the chat template's rendering with ``chat_template_kwargs``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluiceway.engines.base import Logits
from sluiceway.engines.default_model import MARKUP_TOKENS, chat_template
from sluiceway.engines.loader import ModelSource, resolve_model
from sluiceway.engines.mlx_engine import MlxEngine
from sluiceway.engines.tokenizer import ModelTokenizer
from tests.fixtures.scripted_model import (
    EXAMPLE_SCRIPTS,
    EXAMPLE_STOP,
    Script,
    ScriptedModel,
    build_scripted_model,
)

NAMES = [script.name for script in EXAMPLE_SCRIPTS]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris? Answer with <b>bold</b>."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    return build_scripted_model(tmp_path_factory.mktemp("scripted"), EXAMPLE_SCRIPTS)


@pytest.fixture(scope="module")
def source(scripted: ScriptedModel) -> ModelSource:
    return resolve_model(str(scripted.path))


@pytest.fixture(scope="module")
def tokenizer(source: ModelSource) -> ModelTokenizer:
    return ModelTokenizer(source.path, source.vocab_size)


@pytest.fixture(scope="module")
def mlx_engine(source: ModelSource) -> Iterator[MlxEngine]:
    engine = MlxEngine(source)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def torch_model(source: ModelSource) -> Any:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
    return model.eval()


def chat_prompt(tokenizer: ModelTokenizer, scripted: ScriptedModel, name: str) -> list[int]:
    render = tokenizer.chat.render(
        MESSAGES, tools=TOOLS, template_kwargs=scripted.chat_kwargs(name)
    )
    return tokenizer.encode(render.text)


def expected(scripted: ScriptedModel, name: str) -> list[int]:
    """What greedy decoding yields: the script, or for ``end="none"`` two and a
    half passes of it (it loops)."""
    ids = scripted.token_ids(name)
    if scripted.scripts[name].end == "eos":
        return ids
    return (ids * 3)[: len(ids) * 2 + len(ids) // 2]


def budget(scripted: ScriptedModel, name: str) -> int:
    """A token budget: past the EOS of a stopping script, exactly the expected
    length of a looping one."""
    extra = 3 if scripted.scripts[name].end == "eos" else 0
    return len(expected(scripted, name)) + extra


def argmax(logits: Logits) -> int:
    return int(np.argmax(logits[-1]))


def mlx_greedy(engine: MlxEngine, prompt: Sequence[int], count: int, eos: int) -> list[int]:
    out = [argmax(engine.prefill(0, prompt))]
    while len(out) < count and out[-1] != eos:
        out.append(argmax(engine.decode({0: out[-1]}).logits))
    engine.free(0)
    return out


# -- tokenizer and template ----------------------------------------------------


def test_pieces_are_single_tokens(scripted: ScriptedModel, tokenizer: ModelTokenizer) -> None:
    for name, script in scripted.scripts.items():
        for piece, token in zip(script.pieces, scripted.piece_ids[name], strict=True):
            if isinstance(piece, bytes):
                assert tokenizer.table.bytes_of(token) == piece
                assert token not in tokenizer.table.hidden
            else:
                assert tokenizer.encode(piece) == [token], piece
            if piece in MARKUP_TOKENS:
                assert token == tokenizer.hf.convert_tokens_to_ids(piece)
    # Every script reuses the real markup tokens.
    assert scripted.piece_ids["reasoning"][0] == scripted.piece_ids["tool_call"][0]


@pytest.mark.parametrize("name", NAMES)
def test_decoded_text_is_the_script(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, name: str
) -> None:
    ids = scripted.token_ids(name)
    text = scripted.text(name)
    assert tokenizer.table.decode(ids) == text
    selector = scripted.selector_ids[name]
    assert selector in tokenizer.table.hidden
    assert tokenizer.table.decode([selector, *ids]) == text
    assert tokenizer.hf.decode([selector, *ids], skip_special_tokens=True) == text


def test_example_texts(scripted: ScriptedModel) -> None:
    assert scripted.text("reasoning") == (
        "<think>\nThe user asks for bold.\n</think>\n\nUse <b>bold</b> when 1 < 2."
    )
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in scripted.text("tool_call")
    assert scripted.text("bytes_stop") == "Café costs 3€ STOP! tail."
    # The stop string needs three consecutive tokens: " S" | "TO" | "P!".
    texts = [p if isinstance(p, str) else "" for p in scripted.scripts["bytes_stop"].pieces]
    spans = [i for i in range(len(texts) - 2) if EXAMPLE_STOP in "".join(texts[i : i + 3])]
    assert spans == [7]
    assert not any(EXAMPLE_STOP in a + b for a, b in itertools.pairwise(texts))


def test_template_is_the_default_plus_selector(
    scripted: ScriptedModel, tokenizer: ModelTokenizer
) -> None:
    cases: list[dict[str, Any]] = [
        {},
        {"tools": TOOLS},
        {"enable_thinking": False},
        {"tools": TOOLS, "enable_thinking": False},
    ]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    for messages in (MESSAGES, history):
        for case in cases:
            tools = case.get("tools")
            kwargs = {k: v for k, v in case.items() if k != "tools"}
            default = tokenizer.hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=chat_template(),
                **kwargs,
            )
            plain = tokenizer.chat.render(messages, tools=tools, template_kwargs=kwargs)
            assert plain.text == default
            for name in NAMES:
                render = tokenizer.chat.render(
                    messages, tools=tools, template_kwargs=kwargs | scripted.chat_kwargs(name)
                )
                assert render.text == default + scripted.selector(name)
                assert render.assistant_prefix.endswith(scripted.selector(name))
                assert tokenizer.encode(render.text)[-1] == scripted.selector_ids[name]


def test_unknown_script_is_a_template_error(tokenizer: ModelTokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="unknown script"):
        tokenizer.chat.render(MESSAGES, template_kwargs={"script": "nope"})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text())
def test_any_text_tokenizes(tokenizer: ModelTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < len(tokenizer.table) for i in ids)
    if not any(special in text for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
        assert tokenizer.table.decode(ids) == text


# -- engines -------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_mlx_greedy_follows_script(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine, name: str
) -> None:
    want = expected(scripted, name)
    prompt = chat_prompt(tokenizer, scripted, name)
    assert mlx_greedy(mlx_engine, prompt, budget(scripted, name), scripted.eos_id) == want


def test_mlx_raw_prompt_selector_and_long_context(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine
) -> None:
    """A completions prompt selects by its last token, after >512 tokens of text."""
    prompt = tokenizer.encode_prompt("filler <b>text</b> " * 120 + scripted.selector("reasoning"))
    assert len(prompt) > 1000
    assert prompt[-1] == scripted.selector_ids["reasoning"]
    want = scripted.token_ids("reasoning")
    assert mlx_greedy(mlx_engine, prompt, len(want) + 3, scripted.eos_id) == want


def test_mlx_without_selector_ends_at_once(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine
) -> None:
    prompt = tokenizer.encode(tokenizer.chat.render(MESSAGES).text)
    assert mlx_greedy(mlx_engine, prompt, 5, scripted.eos_id) == [scripted.eos_id]


def test_mlx_resumes_mid_script(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine
) -> None:
    """Selector plus the first k pieces in the prompt (assistant prefill,
    tokens-in) continues with piece k+1."""
    want = scripted.token_ids("tool_call")
    prompt = chat_prompt(tokenizer, scripted, "tool_call") + want[:7]
    assert mlx_greedy(mlx_engine, prompt, len(want), scripted.eos_id) == want[7:]


def test_mlx_two_selectors_end_at_once(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine
) -> None:
    prompt = tokenizer.encode_prompt(
        "hi" + scripted.selector("reasoning") + scripted.selector("tool_call")
    )
    assert mlx_greedy(mlx_engine, prompt, 5, scripted.eos_id) == [scripted.eos_id]


def test_mlx_continuous_batch(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine
) -> None:
    """Scripts that join the running batch at different steps all stay on script."""
    wants = {slot: expected(scripted, name) for slot, name in enumerate(NAMES)}
    outs: dict[int, list[int]] = {}
    running: set[int] = set()
    for step in range(max(map(len, wants.values())) + len(NAMES)):
        if step < len(NAMES):  # slot `step` joins now
            prompt = chat_prompt(tokenizer, scripted, NAMES[step])
            outs[step] = [argmax(mlx_engine.prefill(step, prompt))]
        feed = {slot: outs[slot][-1] for slot in [*running, *([step] if step < len(NAMES) else [])]}
        if not feed:
            break
        result = mlx_engine.decode(feed)
        running = set(feed)
        for row, slot in enumerate(result.slots):
            outs[slot].append(int(np.argmax(result.logits[row])))
            if outs[slot][-1] == scripted.eos_id or len(outs[slot]) >= len(wants[slot]):
                mlx_engine.free(slot)
                running.discard(slot)
    assert outs == wants


@pytest.mark.parametrize("name", NAMES)
def test_torch_generate_follows_script(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, torch_model: Any, name: str
) -> None:
    import torch

    want = expected(scripted, name)
    prompt = torch.tensor([chat_prompt(tokenizer, scripted, name)])
    out = torch_model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=budget(scripted, name),
        pad_token_id=scripted.eos_id,
    )
    assert out[0, prompt.shape[1] :].tolist() == want


def test_engines_agree_on_logprobs(
    scripted: ScriptedModel, tokenizer: ModelTokenizer, mlx_engine: MlxEngine, torch_model: Any
) -> None:
    """Both engines give the same distribution at every position; the chosen
    token wins by a wide margin and the alternatives are strictly ordered."""
    import torch

    ids = chat_prompt(tokenizer, scripted, "tool_call") + scripted.token_ids("tool_call")[:-1]
    mlx_logits = mlx_engine.prefill(0, ids, all_logits=True)
    mlx_engine.free(0)
    with torch.no_grad():
        torch_logits = torch_model(torch.tensor([ids])).logits[0].float().numpy()

    def log_softmax(x: Logits) -> Logits:
        shifted = x - x.max(axis=-1, keepdims=True)
        out: Logits = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        return out

    np.testing.assert_allclose(log_softmax(mlx_logits), log_softmax(torch_logits), atol=1e-4)
    generated = len(scripted.token_ids("tool_call"))
    for row in mlx_logits[-generated:]:
        top = np.sort(row)[::-1]
        assert top[0] - top[1] > 25
        assert np.all(np.diff(top[1:6]) < 0)
        assert log_softmax(row).max() > -1e-6


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("scripts", "message"),
    [
        ([Script("a", ("x", "yy", "x"))], "same token"),
        ([Script("a", ("x", b"x"))], "same token"),
        ([Script("a", ("<|im_end|>",))], "special token"),
        ([Script("a", ("x",)), Script("b", ("<|script:a|>",))], "special token"),
        ([Script("a", ("x",)), Script("a", ("y",))], "duplicate script names"),
    ],
)
def test_invalid_scripts(tmp_path: Path, scripts: list[Script], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_scripted_model(tmp_path, scripts)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "a|b", "pieces": ("x",)}, "must match"),
        ({"name": "a", "pieces": ("",)}, "non-empty"),
        ({"name": "a", "pieces": (), "end": "none"}, "at least one piece"),
    ],
)
def test_invalid_script(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Script(**kwargs)


# -- priorities and a long context ----------------------------------------------

#: Two scripts that continue from the same token, one outranking the other.
LOW = Script("low", ("@", "low1", " low2"))
HIGH = Script("high", ("@", "high1", " high2"), priority=1)
LONG_CONTEXT = 49152


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    return build_scripted_model(
        tmp_path_factory.mktemp("ranked"), [LOW, HIGH], max_position_embeddings=LONG_CONTEXT
    )


@pytest.fixture(scope="module")
def ranked_tokenizer(ranked: ScriptedModel) -> ModelTokenizer:
    source = resolve_model(str(ranked.path))
    return ModelTokenizer(source.path, source.vocab_size)


@pytest.fixture(scope="module")
def ranked_mlx(ranked: ScriptedModel) -> Iterator[MlxEngine]:
    engine = MlxEngine(resolve_model(str(ranked.path)))
    yield engine
    engine.close()


def after_both(ranked: ScriptedModel, first: str, second: str, filler: str = " filler ") -> str:
    """A prompt holding both selectors, ending with the token both scripts continue from."""
    return "hi" + ranked.selector(first) + filler + ranked.selector(second) + " then @"


@pytest.mark.parametrize(("first", "second"), [("low", "high"), ("high", "low")])
def test_a_higher_priority_selector_outranks_a_lower_one(
    ranked: ScriptedModel,
    ranked_tokenizer: ModelTokenizer,
    ranked_mlx: MlxEngine,
    first: str,
    second: str,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = ranked_tokenizer.encode_prompt(after_both(ranked, first, second))
    assert prompt[-1] == ranked.piece_ids["high"][0]
    want = ranked.token_ids("high")[1:]
    assert mlx_greedy(ranked_mlx, prompt, len(want) + 2, ranked.eos_id) == want
    model: Any = AutoModelForCausalLM.from_pretrained(str(ranked.path), dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.eval().generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=len(want) + 2,
        pad_token_id=ranked.eos_id,
    )
    assert out[0, ids.shape[1] :].tolist() == want


def test_a_selector_holds_across_a_long_context(
    ranked: ScriptedModel, ranked_tokenizer: ModelTokenizer, ranked_mlx: MlxEngine
) -> None:
    """``rope_theta`` is raised with the context, so that a selector 40k
    tokens back still outranks one near the end (with the default 1e6 its
    key would have turned by 1.3 rad there)."""
    config = json.loads((ranked.path / "config.json").read_text())
    assert config["max_position_embeddings"] == LONG_CONTEXT
    assert config["rope_theta"] > 1e6
    prompt = ranked_tokenizer.encode_prompt(after_both(ranked, "high", "low", "z" * 40_000))
    assert len(prompt) > 40_000
    want = ranked.token_ids("high")[1:]
    assert mlx_greedy(ranked_mlx, prompt, len(want) + 2, ranked.eos_id) == want
