"""The parsers by name, and building one choice's text path from request options.

Both registries are read-only mappings built at import time; a request's
options select from them and :func:`build_pipeline` assembles fresh stages for
each choice (stages are stateful, so they are never shared).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, TypeVar

from sluiceway.parsers import formats, reasoning
from sluiceway.parsers.events import Channel
from sluiceway.parsers.formats import FORMATS, ToolSchema
from sluiceway.parsers.formats.render import forced_prefix
from sluiceway.parsers.harmony import HarmonyParser, HarmonyTokens
from sluiceway.parsers.pipeline import ChoicePipeline, StopStage, TextStage
from sluiceway.parsers.stages import ParserError
from sluiceway.parsers.stop import StopMatcher
from sluiceway.protocol.tokens import TokenTable

__all__ = [
    "HARMONY_REASONING",
    "HARMONY_TOOLS",
    "REASONING_NAMES",
    "REASONING_PARSERS",
    "TOOL_NAMES",
    "TOOL_PARSERS",
    "ParserChoice",
    "PrimedStage",
    "TextPathOptions",
    "ToolParserFactory",
    "ToolSchema",
    "UnknownParserError",
    "build_pipeline",
    "build_stages",
    "detect_parsers",
    "forced_reasoning_close",
    "forced_tool_prefix",
    "is_harmony",
    "markup_texts",
    "mentions_tools",
]


_T = TypeVar("_T")


class UnknownParserError(ParserError, ValueError):
    """A reasoning or tool parser name that is not registered."""


class PrimedStage(TextStage, Protocol):
    """A stage whose starting state comes from text at the end of the prompt."""

    def prime(self, text: str) -> None: ...


class ToolParserFactory(Protocol):
    def __call__(
        self, *, tools: tuple[ToolSchema, ...], parallel_tool_calls: bool
    ) -> PrimedStage: ...


REASONING_PARSERS: Mapping[str, Callable[[], PrimedStage]] = MappingProxyType(
    {name: reasoning.parser_of(dialect) for name, dialect in reasoning.DIALECTS.items()}
)

# Reading GRAPHS compiles every format's graph here, when the server imports
# the registry at start-up, rather than in a first request.
TOOL_PARSERS: Mapping[str, ToolParserFactory] = MappingProxyType(
    {name: functools.partial(formats.parser, name) for name in formats.GRAPHS}
)


#: vLLM's names for gpt-oss's harmony (one reader by token id does the work
#: of both parsers: :mod:`sluiceway.parsers.harmony`).
HARMONY_REASONING = "openai_gptoss"
HARMONY_TOOLS = "openai"

#: Every name ``--reasoning-parser`` / ``--tool-call-parser`` takes.
REASONING_NAMES = (*REASONING_PARSERS, HARMONY_REASONING)
TOOL_NAMES = (*TOOL_PARSERS, HARMONY_TOOLS)


def is_harmony(reasoning_parser: str | None, tool_parser: str | None = None) -> bool:
    """Whether the text path reads harmony (either name selects it)."""
    return reasoning_parser == HARMONY_REASONING or tool_parser == HARMONY_TOOLS


@dataclass(frozen=True, slots=True)
class ParserChoice:
    """The reasoning and tool-call parsers the server runs (None: none)."""

    reasoning: str | None
    tools: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class TextPathOptions:
    """Everything of a request that shapes one choice's text path."""

    reasoning_parser: str | None = None  # a name in REASONING_PARSERS
    tool_parser: str | None = None  # a name in TOOL_PARSERS; None = no tool parsing
    tools: tuple[ToolSchema, ...] = ()
    parallel_tool_calls: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    stop_in_reasoning: bool = False
    assistant_prefix: str = ""  # primes the reasoning parser
    forced_prefix: str = ""  # appended to the prompt to force a tool call; primes both parsers


def build_stages(options: TextPathOptions) -> tuple[tuple[TextStage, ...], StopStage | None]:
    """Fresh, primed stages in pipeline order (reasoning, stop, tools), and the
    stop stage (harmony's parsers are the pipeline's reader instead)."""
    harmony = is_harmony(options.reasoning_parser, options.tool_parser)
    stages: list[TextStage] = []
    if options.reasoning_parser is not None and not harmony:
        thinking = _lookup(REASONING_PARSERS, options.reasoning_parser, "reasoning")()
        thinking.prime(options.assistant_prefix + options.forced_prefix)
        stages.append(thinking)
    stop: StopStage | None = None
    if options.stop:
        stop = StopMatcher(
            options.stop,
            include_stop_str_in_output=options.include_stop_str_in_output,
            min_tokens=options.min_tokens,
            match_in_reasoning=options.stop_in_reasoning,
        )
        stages.append(stop)
    if options.tool_parser is not None and not harmony:
        factory = _lookup(TOOL_PARSERS, options.tool_parser, "tool")
        tools = factory(tools=options.tools, parallel_tool_calls=options.parallel_tool_calls)
        tools.prime(options.forced_prefix)
        stages.append(tools)
    return tuple(stages), stop


def build_pipeline(table: TokenTable, options: TextPathOptions) -> ChoicePipeline:
    """One choice's text path; with default options exactly ``ChoicePipeline(table)``."""
    stages, stop = build_stages(options)
    if not is_harmony(options.reasoning_parser, options.tool_parser):
        return ChoicePipeline(table, stages, stop=stop)
    reader = HarmonyParser(HarmonyTokens.of(table), parallel_tool_calls=options.parallel_tool_calls)
    reader.prime(options.assistant_prefix + options.forced_prefix)
    return ChoicePipeline(table, stages, stop=stop, reader=reader)


def forced_tool_prefix(tool_parser: str, name: str | None) -> str:
    """The assistant prefix that forces a tool call: any tool (``None``, i.e.
    ``tool_choice: "required"``) or the named function."""
    if tool_parser == HARMONY_TOOLS:
        named = f"{name} <|constrain|>json<|message|>" if name is not None else ""
        return "<|channel|>commentary to=functions." + named
    return forced_prefix(_lookup(FORMATS, tool_parser, "tool"), name)


def forced_reasoning_close(reasoning_parser: str | None, assistant_prefix: str) -> str:
    """What a forced tool call's prefix starts with: the close of the
    reasoning block the assistant prefix left open (a forced call cannot
    start inside reasoning), or nothing."""
    if reasoning_parser is None or reasoning_parser == HARMONY_REASONING:
        return ""  # a harmony prompt ends between messages
    stage = _lookup(REASONING_PARSERS, reasoning_parser, "reasoning")()
    stage.prime(assistant_prefix)
    if stage.open_channel(Channel.CONTENT) is not Channel.REASONING:
        return ""
    return reasoning.DIALECTS[reasoning_parser].forced_close


def detect_parsers(
    chat_template: str | None, vocabulary: Collection[str], generation_prefixes: Iterable[str]
) -> tuple[str | None, str | None]:
    """The (reasoning, tool) parsers a model's template and vocabulary call for,
    each only where the evidence is unambiguous (else ``None``).

    ``generation_prefixes`` are what the template adds for the generation
    prompt, rendered by the tokenizer with the thinking switch unset, on and
    off (those that render): they tell whether the output always starts
    inside reasoning.
    """
    if not chat_template:
        return None, None
    if all(marker in vocabulary for marker in _HARMONY_EVIDENCE) and "<|channel|>" in chat_template:
        return HARMONY_REASONING, HARMONY_TOOLS
    return (
        _detect_reasoning(chat_template, vocabulary, tuple(generation_prefixes)),
        _detect_tools(chat_template, vocabulary),
    )


def _detect_reasoning(
    template: str, vocabulary: Collection[str], prefixes: tuple[str, ...]
) -> str | None:
    if "[THINK]" in vocabulary and "[THINK]" in template:
        return "mistral"
    if "<think>" not in vocabulary or "</think>" not in vocabulary or "think" not in template:
        return None
    family = _detect_tools(template, vocabulary)
    if family is not None and family in _FAMILY_REASONING:
        return _FAMILY_REASONING[family]
    return "deepseek_r1" if _always_opens_think(prefixes) else "qwen3"


#: Harmony's markers that its models' vocabularies hold as tokens.
_HARMONY_EVIDENCE = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")

#: Families whose reasoning a tool call may end (see ``ReasoningDialect.ends_at``).
_FAMILY_REASONING: Mapping[str, str] = MappingProxyType(
    {
        "glm45": "glm45",
        "glm47": "glm45",
        "kimi_k2": "kimi_k2",
        "minimax_m2": "minimax_m2",
        "deepseek_v31": "deepseek_v3",
        "deepseek_v3": "deepseek_v3",
    }
)

#: (family, evidence in the template): the first whose evidence is all there wins.
_TOOL_EVIDENCE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>", "```json")),
    ("deepseek_v31", ("<｜tool▁calls▁begin｜>",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("glm45", ("<arg_key>", "\n<arg_value>")),
    ("glm47", ("<arg_key>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("qwen3_coder", ("<tool_call>", "<function=")),
    ("hermes", ("<tool_call>",)),
    ("pythonic", ("[func_name1(",)),
    ("llama3_json", ('"parameters": dictionary of argument name',)),
    ("llama3_json", ("<|python_tag|>",)),
)


def _detect_tools(template: str, vocabulary: Collection[str]) -> str | None:
    for family, evidence in _TOOL_EVIDENCE:
        if all(text in template for text in evidence) and _spelled(family, vocabulary):
            return family
    return None


def _spelled(family: str, vocabulary: Collection[str]) -> bool:
    """The family's first markup is one token of the vocabulary, where its
    models have it so (plain-text markup such as ``[`` needs no token)."""
    fmt = FORMATS[family]
    openers = [lit.text for lit, _ in formats.GRAPHS[family].entry]
    if any(text not in fmt.special for text in openers):
        return True
    return all(text in vocabulary for text in openers)


def mentions_tools(template: str | None) -> bool:
    """Whether a chat template renders tool calls at all."""
    return template is not None and "tool_calls" in template


def markup_texts(reasoning_parser: str | None, tool_parser: str | None) -> tuple[str, ...]:
    """The markup the chosen parsers read: where the tokenizer has it as a
    special token, the token must show in the text the parsers are fed."""
    texts: list[str] = []
    if is_harmony(reasoning_parser, tool_parser):
        return ()  # read by token id: special tokens stay out of the text
    if reasoning_parser is not None:
        dialect = reasoning.DIALECTS[reasoning_parser]
        texts += [dialect.open_tag, dialect.close_tag, *dialect.ends_at]
    if tool_parser is not None:
        texts += FORMATS[tool_parser].special
    return tuple(dict.fromkeys(texts))


def _always_opens_think(prefixes: tuple[str, ...]) -> bool:
    """Whether the generation prompt opens ``<think>`` whatever the thinking switch says."""
    return bool(prefixes) and all(
        prefix.rfind("<think>") > prefix.rfind("</think>") for prefix in prefixes
    )


def _lookup(registry: Mapping[str, _T], name: str, kind: str) -> _T:
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise UnknownParserError(f"unknown {kind} parser {name!r} (known: {known})") from None
