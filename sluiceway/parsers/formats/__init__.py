"""Tool-call formats: one description per family, and what is derived from it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

from sluiceway.parsers.formats.arguments import ToolSchema
from sluiceway.parsers.formats.families import FORMATS
from sluiceway.parsers.formats.graph import Graph
from sluiceway.parsers.formats.parser import FormatParser

__all__ = ["FORMATS", "GRAPHS", "FormatParser", "ToolSchema", "graph_of", "parser"]


@functools.cache
def graph_of(name: str) -> Graph:
    return Graph(FORMATS[name])


GRAPHS: Mapping[str, Graph] = MappingProxyType({name: graph_of(name) for name in FORMATS})


def parser(
    name: str, *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
) -> FormatParser:
    """A fresh parser of format ``name``."""
    return FormatParser(GRAPHS[name], tools=tools, parallel_tool_calls=parallel_tool_calls)
