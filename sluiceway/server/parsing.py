"""Which parsers the server's text paths use (``--reasoning-parser``,
``--tool-call-parser``; ``auto`` reads the chat template)."""

from __future__ import annotations

import logging

from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.registry import ParserChoice, detect_parsers
from sluiceway.server.config import ServerConfig

logger = logging.getLogger(__name__)


def choose_parsers(config: ServerConfig, tokenizer: ModelTokenizer) -> ParserChoice:
    """``auto`` picks from the chat template and vocabulary where unambiguous."""
    detected = detect_parsers(
        tokenizer.chat.source, tokenizer.vocabulary(), tokenizer.chat.generation_prefixes()
    )
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
