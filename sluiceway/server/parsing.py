"""Which parsers a request's text path uses, and the options that build it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.events import Channel
from sluiceway.parsers.registry import REASONING_PARSERS, detect_parsers
from sluiceway.server.config import ServerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParserChoice:
    """The reasoning and tool-call parsers the server runs (None: none)."""

    reasoning: str | None
    tools: str | None


def choose_parsers(config: ServerConfig, tokenizer: ModelTokenizer) -> ParserChoice:
    """``auto`` picks from the chat template and vocabulary where unambiguous."""
    vocabulary = frozenset(tokenizer.hf.get_vocab())
    detected = detect_parsers(tokenizer.chat_template, vocabulary)
    reasoning = _pick(config.reasoning_parser, detected[0])
    tools = _pick(config.tool_call_parser, detected[1])
    logger.info(
        "reasoning parser: %s (%s); tool-call parser: %s (%s)",
        reasoning or "none",
        config.reasoning_parser,
        tools or "none",
        config.tool_call_parser,
    )
    return ParserChoice(reasoning, tools)


def _pick(setting: str, detected: str | None) -> str | None:
    if setting == "auto":
        return detected
    return None if setting == "none" else setting


def reasoning_left_open(parser: str | None, assistant_prefix: str) -> bool:
    """Whether the output starts inside reasoning after this assistant prefix."""
    if parser is None:
        return False
    stage = REASONING_PARSERS[parser]()
    stage.prime(assistant_prefix)
    return stage.open_channel(Channel.CONTENT) is Channel.REASONING
