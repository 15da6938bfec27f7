"""Which parsers the server's text paths use (``--reasoning-parser``,
``--tool-call-parser``; ``auto`` reads the chat template)."""

from __future__ import annotations

import logging
from dataclasses import replace

from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.registry import ParserChoice, detect_parsers, markup_texts, mentions_tools
from sluiceway.server.config import ServerConfig

logger = logging.getLogger(__name__)


def choose_parsers(config: ServerConfig, tokenizer: ModelTokenizer) -> ParserChoice:
    """``auto`` picks from the chat template and vocabulary where unambiguous."""
    detected = detect_parsers(
        tokenizer.chat.source, tokenizer.vocabulary(), tokenizer.chat.generation_prefixes()
    )
    reasoning = _pick(config.reasoning_parser, detected[0])
    tools = _pick(config.tool_call_parser, detected[1])
    if (
        tools is None
        and config.tool_call_parser == "auto"
        and mentions_tools(tokenizer.chat.source)
    ):
        logger.warning(
            "the chat template renders tool calls in a markup no known family writes: "
            "calls will reach clients as plain text; name the format with --tool-call-parser"
        )
    reveal(tokenizer, markup_texts(reasoning, tools))
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


def reveal(tokenizer: ModelTokenizer, texts: tuple[str, ...]) -> None:
    """Make the parsers' markup tokens show in decoded text.

    Tokenizers mark markup such as ``<|tool_call_begin|>`` or ``[TOOL_CALLS]``
    special, and special tokens are left out of the output; the parsers must
    see them to read the markup (they then route them as markup, never
    content).
    """
    table = tokenizer.table
    shown = {token for text in texts if (token := tokenizer.single_token(text)) is not None}
    if shown & table.hidden:
        tokenizer.table = replace(table, hidden=table.hidden - shown)
