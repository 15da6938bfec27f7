"""Tool-call formats: one description per family, and what is derived from it."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from sluiceway.parsers.formats.arguments import ToolSchema
from sluiceway.parsers.formats.families import FORMATS
from sluiceway.parsers.formats.graph import Graph
from sluiceway.parsers.formats.parser import FormatParser

__all__ = ["FORMATS", "GRAPHS", "FormatParser", "ToolSchema", "parser"]

#: Each format's compiled graph (compiling checks that it is deterministic).
GRAPHS: Mapping[str, Graph] = MappingProxyType({name: Graph(fmt) for name, fmt in FORMATS.items()})


def parser(
    name: str, *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
) -> FormatParser:
    """A fresh parser of format ``name``."""
    return FormatParser(GRAPHS[name], tools=tools, parallel_tool_calls=parallel_tool_calls)
