"""Tool-call formats: one description per family, and what is derived from it."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from types import MappingProxyType

from sluiceway.parsers.formats.arguments import ToolSchema
from sluiceway.parsers.formats.families import FORMATS, OnFirstUse, formats
from sluiceway.parsers.formats.graph import Graph
from sluiceway.parsers.formats.parser import FormatParser

__all__ = ["FORMATS", "GRAPHS", "FormatParser", "ToolSchema", "formats", "graphs", "parser"]


@cache
def graphs() -> Mapping[str, Graph]:
    """Each format's compiled graph (compiling checks that it is deterministic),
    compiled once, on first use, from :func:`formats` (why not at import:
    :mod:`sluiceway.parsers.formats.families`)."""
    return MappingProxyType({name: Graph(fmt) for name, fmt in formats().items()})


#: :func:`graphs`, readable as a mapping from import on.
GRAPHS: Mapping[str, Graph] = OnFirstUse(graphs)


def parser(
    name: str, *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
) -> FormatParser:
    """A fresh parser of format ``name``."""
    return FormatParser(graphs()[name], tools=tools, parallel_tool_calls=parallel_tool_calls)
