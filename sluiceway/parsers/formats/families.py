"""Every tool-call format family, as data, under vLLM's parser names.

Each description is checked against the family's published chat template and
vLLM's parser for it; where a family writes optional whitespace, the
canonical rendering (``pre``) follows the template.

The families are built on first use, by :func:`formats`, not at import: a
description assembled by a helper of this module (``_glm``, ``_deepseek``,
``_json_object_call``, ``_python_call``) is then assembled by whatever that
helper is when it first runs. Mutation testing depends on it: mutmut imports
the package once and switches a mutant on in each forked child, so a
description built at import would never see the mutant; under
``SLUICEWAY_MUTATE=1`` tests/conftest.py clears the cache before each test
(``formats.cache_clear()``). A server builds them at start-up all the same
(:mod:`sluiceway.parsers.registry` compiles every graph when it is imported).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import cache
from types import MappingProxyType
from typing import TypeVar

from sluiceway.parsers.formats.spec import (
    Index,
    JsonArguments,
    Lit,
    Name,
    Opt,
    Part,
    PythonArguments,
    Repeat,
    Tagged,
    ToolFormat,
    choice,
    seq,
)


def _json_object_call(*, pre: str, keys: tuple[str, ...]) -> Part:
    """``{"name": "f", "arguments": {...}}`` (llama3_json, mistral's list form)."""
    arguments = [Lit(key, pre=" ") for key in keys]
    return seq(
        Lit("{", pre=pre),
        Lit('"name"'),
        Lit(":"),
        Lit('"', pre=" "),
        Name(),
        Lit('"', tight=True),
        Lit(","),
        arguments[0] if len(arguments) == 1 else choice(*arguments),
        Lit(":"),
        JsonArguments(pre=" "),
        Lit("}", ends_args=True),
    )


HERMES = ToolFormat(
    name="hermes",
    body=seq(
        Lit("<tool_call>"),
        Lit("{", pre="\n"),
        Lit('"name"'),
        Lit(":"),
        Lit('"', pre=" "),
        Name(),
        Lit('"', tight=True),
        Opt(seq(Lit(","), Lit('"arguments"', pre=" "), Lit(":"), JsonArguments(pre=" "))),
        Lit("}", ends_args=True),
        Lit("</tool_call>", pre="\n"),
    ),
    special=("<tool_call>", "</tool_call>"),
)

QWEN3_CODER = ToolFormat(
    name="qwen3_coder",
    body=seq(
        Lit("<tool_call>"),
        Lit("<function=", pre="\n"),
        Name(),
        Lit(">", tight=True),
        Tagged(
            open=Lit("<parameter=", pre="\n"),
            close_key=Lit(">", tight=True, closes_key=True),
            value_open=None,
            close="</parameter>",
            value_pre="\n",
        ),
        Lit("</function>", pre="\n", ends_args=True),
        Lit("</tool_call>", pre="\n"),
    ),
    special=("<tool_call>", "</tool_call>"),
)


def _glm(name: str, newline: str) -> ToolFormat:
    return ToolFormat(
        name=name,
        body=seq(
            Lit("<tool_call>"),
            Name(),
            Tagged(
                open=Lit("<arg_key>", pre=newline),
                close_key=Lit("</arg_key>", tight=True, closes_key=True),
                value_open=Lit("<arg_value>", pre=newline),
                close="</arg_value>",
            ),
            Lit("</tool_call>", pre=newline, ends_args=True),
        ),
        special=(
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
    )


_KIMI_CALL = seq(
    Lit("<|tool_call_begin|>"),
    Lit("functions."),
    Name(),
    Lit(":", tight=True),
    Index(),
    Lit("<|tool_call_argument_begin|>"),
    JsonArguments(),
    Lit("<|tool_call_end|>", ends_args=True),
)

KIMI_K2 = ToolFormat(
    name="kimi_k2",
    body=seq(
        Lit("<|tool_calls_section_begin|>"),
        _KIMI_CALL,
        Repeat(_KIMI_CALL),
        Lit("<|tool_calls_section_end|>"),
    ),
    call_id="functions.{name}:{index}",
    name_chars=r'[^"\\<>\s\x00-\x1f:]',
    special=(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
)

_INVOKE = seq(
    Lit('<invoke name="', pre="\n"),
    Name(),
    Lit('">', tight=True),
    Tagged(
        open=Lit('<parameter name="', pre="\n"),
        close_key=Lit('">', tight=True, closes_key=True),
        value_open=None,
        close="</parameter>",
    ),
    Lit("</invoke>", pre="\n", ends_args=True),
)

MINIMAX_M2 = ToolFormat(
    name="minimax_m2",
    body=seq(
        Lit("<minimax:tool_call>"), _INVOKE, Repeat(_INVOKE), Lit("</minimax:tool_call>", pre="\n")
    ),
    special=("<minimax:tool_call>", "</minimax:tool_call>"),
)

_DEEPSEEK_SPECIAL = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


def _deepseek(name: str, call: Part) -> ToolFormat:
    return ToolFormat(
        name=name,
        body=seq(Lit("<｜tool▁calls▁begin｜>"), call, Repeat(call), Lit("<｜tool▁calls▁end｜>")),
        # A name may be followed by its fenced arguments with no newline between.
        name_chars=r'[^"\\<>\s\x00-\x1f`]',
        special=_DEEPSEEK_SPECIAL,
    )


#: DeepSeek V3.1's call: ``NAME<｜tool▁sep｜>{json}``.
_DEEPSEEK_V31_CALL = seq(
    Lit("<｜tool▁call▁begin｜>"),
    Name(),
    Lit("<｜tool▁sep｜>", tight=True),
    JsonArguments(),
    Lit("<｜tool▁call▁end｜>", ends_args=True),
)

#: DeepSeek V3 and R1's call: ``function<｜tool▁sep｜>NAME`` and a fenced JSON block.
_DEEPSEEK_V3_CALL = seq(
    Lit("<｜tool▁call▁begin｜>"),
    Lit("function"),
    Lit("<｜tool▁sep｜>", tight=True),
    Name(),
    Lit("```json", pre="\n"),
    JsonArguments(pre="\n"),
    Lit("```", pre="\n"),
    Lit("<｜tool▁call▁end｜>", ends_args=True),
)

_LLAMA_KEYS = ('"parameters"', '"arguments"')


def _llama3_json() -> ToolFormat:
    return ToolFormat(
        name="llama3_json",
        body=seq(
            Opt(Lit("<|python_tag|>")),
            _json_object_call(pre="", keys=_LLAMA_KEYS),
            Repeat(seq(Lit(";"), _json_object_call(pre=" ", keys=_LLAMA_KEYS))),
        ),
        at_start=True,
        special=("<|python_tag|>",),
    )


def _python_call(pre: str) -> Part:
    return seq(
        Name(ws=True, pre=pre),
        Lit("(", tight=True),
        PythonArguments(),
        Lit(")", ends_args=True),
    )


def _pythonic() -> ToolFormat:
    return ToolFormat(
        name="pythonic",
        body=seq(
            Opt(Lit("<|python_start|>")),
            Lit("["),
            _python_call(""),
            Repeat(seq(Lit(","), _python_call(" "))),
            Lit("]"),
            Opt(Lit("<|python_end|>")),
        ),
        at_start=True,
        name_chars=r"[\w.\-]",
        special=("<|python_start|>", "<|python_end|>"),
    )


_MISTRAL_CALL = seq(Name(), Lit("[ARGS]", tight=True), JsonArguments())


def _mistral() -> ToolFormat:
    return ToolFormat(
        name="mistral",
        body=seq(
            Lit("[TOOL_CALLS]"),
            choice(
                # Mistral Small 3.2, Devstral, Magistral (tokenizer v11 and later).
                seq(_MISTRAL_CALL, Repeat(seq(Lit("[TOOL_CALLS]"), _MISTRAL_CALL))),
                # Earlier models: a JSON list of calls.
                seq(
                    Lit("["),
                    _json_object_call(pre="", keys=('"arguments"',)),
                    Repeat(seq(Lit(","), _json_object_call(pre=" ", keys=('"arguments"',)))),
                    Lit("]"),
                ),
            ),
        ),
        name_chars=r'[^"\\<>\s\x00-\x1f\[]',
        special=("[TOOL_CALLS]", "[ARGS]"),
    )


@cache
def formats() -> Mapping[str, ToolFormat]:
    """Every family by its vLLM parser name, built once, on first use."""
    built = (
        HERMES,
        QWEN3_CODER,
        # GLM-4.5 and 4.6 write a newline after the name and between the tags;
        # GLM-4.7 writes the tags back to back.
        _glm("glm45", "\n"),
        _glm("glm47", ""),
        KIMI_K2,
        MINIMAX_M2,
        _deepseek("deepseek_v31", _DEEPSEEK_V31_CALL),
        _deepseek("deepseek_v3", _DEEPSEEK_V3_CALL),
        _llama3_json(),
        _pythonic(),
        _mistral(),
    )
    return MappingProxyType({fmt.name: fmt for fmt in built})


_V = TypeVar("_V")


class OnFirstUse(Mapping[str, _V]):
    """A read-only mapping that reads ``build()`` at each access: a name bound
    at import (``from ... import FORMATS``) still sees what ``build`` returns
    now, so the cached build may be cleared and made again."""

    def __init__(self, build: Callable[[], Mapping[str, _V]]) -> None:
        self._build = build

    def __getitem__(self, key: str) -> _V:
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())


#: :func:`formats`, readable as a mapping from import on.
FORMATS: Mapping[str, ToolFormat] = OnFirstUse(formats)
