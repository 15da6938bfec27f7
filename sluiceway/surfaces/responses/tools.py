"""The request's tools as the chat template sees them, and the way back from
a called name to the Responses tool it stands for.

- A ``function`` tool is offered as it is.
- A ``custom`` tool (free-text input, such as Codex's ``apply_patch``) is
  offered as a function with one string parameter, ``input``; a call comes
  back as a ``custom_tool_call`` item whose ``input`` is that string.
- The members of a ``namespace`` tool are offered under qualified names,
  ``<namespace>__<name>``; a call comes back with ``namespace`` and ``name``
  apart (Codex resolves calls by the pair).
- Hosted tools (``web_search``, ``file_search``, ...) are accepted and not
  offered: this server cannot run them. A ``tool_choice`` that names one is
  a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces.conversation import ToolChoice, ToolChoiceMode, ToolSpec
from sluiceway.surfaces.responses.wire import (
    AllowedToolsChoice,
    CustomTool,
    FunctionTool,
    HostedChoice,
    HostedTool,
    NamedChoice,
    NamespaceTool,
    ResponsesRequest,
    Tool,
)

NAMESPACE_SEPARATOR = "__"

#: The one parameter a custom tool is offered with.
CUSTOM_INPUT = "input"
_CUSTOM_PARAMETERS: Mapping[str, Any] = MappingProxyType(
    {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "The tool's input."}},
        "required": [CUSTOM_INPUT],
    }
)

_MODES = {
    "none": ToolChoiceMode.NONE,
    "auto": ToolChoiceMode.AUTO,
    "required": ToolChoiceMode.REQUIRED,
}


@dataclass(frozen=True, slots=True)
class ToolRef:
    """What a name the model calls stands for."""

    name: str
    namespace: str | None = None
    custom: bool = False
    #: Where the request holds its arguments schema (errors name it).
    parameters: str | None = None


def qualified(namespace: str | None, name: str) -> str:
    return name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


@dataclass(frozen=True, slots=True)
class ToolTable:
    """The offered tools (neutral specs) and the way back from their names."""

    specs: tuple[ToolSpec, ...] = ()
    refs: Mapping[str, ToolRef] = field(default_factory=dict)

    def ref(self, called: str) -> ToolRef:
        """The tool a called name stands for (a name the request never
        offered comes back as a plain function call)."""
        return self.refs.get(called) or ToolRef(name=called)

    def resolve(self, name: str, *, param: str) -> str:
        """The offered name that a ``tool_choice`` name means: a qualified
        name, or a namespace member's own name when only one member has it."""
        if name in self.refs:
            return name
        members = [key for key, ref in self.refs.items() if ref.name == name]
        if len(members) == 1:
            return members[0]
        raise InvalidRequest(f"{param} names {name!r}, which is not among the tools", param=param)


def call_arguments(ref: ToolRef, text: str) -> str:
    """A replayed call's arguments as the model would have written them."""
    return json.dumps({CUSTOM_INPUT: text}) if ref.custom else text


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote: the
    ``input`` string, or the text as written when it is not that shape."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(value[CUSTOM_INPUT])
    return arguments


def tool_table(tools: list[Tool]) -> ToolTable:
    specs: list[ToolSpec] = []
    refs: dict[str, ToolRef] = {}
    for index, tool in enumerate(tools):
        if isinstance(tool, HostedTool):
            continue
        members = tool.tools if isinstance(tool, NamespaceTool) else [tool]
        namespace = tool if isinstance(tool, NamespaceTool) else None
        for place, member in enumerate(members):
            where = f"tools[{index}]" if namespace is None else f"tools[{index}].tools[{place}]"
            spec, ref = _offered(member, namespace, where)
            if spec.name in refs:
                raise InvalidRequest(
                    f"tools[{index}]: the tool name {spec.name!r} is used twice",
                    param=f"tools[{index}]",
                )
            specs.append(spec)
            refs[spec.name] = ref
    return ToolTable(tuple(specs), MappingProxyType(refs))


def _offered(
    tool: FunctionTool | CustomTool, namespace: NamespaceTool | None, where: str
) -> tuple[ToolSpec, ToolRef]:
    space = None if namespace is None else namespace.name
    custom = isinstance(tool, CustomTool)
    parameters = None if custom else f"{where}.parameters"
    ref = ToolRef(name=tool.name, namespace=space, custom=custom, parameters=parameters)
    description = tool.description
    if namespace is not None and namespace.description:
        description = f"{namespace.description}\n\n{description or ''}".rstrip()
    if isinstance(tool, FunctionTool):
        spec = ToolSpec(
            name=qualified(space, tool.name),
            description=description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        return spec, ref
    grammar = tool.format
    if grammar is not None and grammar.type == "grammar" and grammar.definition:
        # Shown, not enforced: the model learns the syntax its input must follow.
        description = (
            f"{description or ''}\n\nThe input follows this {grammar.syntax or ''} grammar:\n"
            f"{grammar.definition}"
        ).lstrip()
    spec = ToolSpec(
        name=qualified(space, tool.name), description=description, parameters=_CUSTOM_PARAMETERS
    )
    return spec, ref


def tool_choice(request: ResponsesRequest, table: ToolTable) -> tuple[ToolChoice | None, ToolTable]:
    """The neutral tool choice, and the tools it leaves on offer."""
    choice = request.tool_choice
    if choice is None:
        return None, table
    if isinstance(choice, str):
        return ToolChoice(mode=_MODES[choice]), table
    if isinstance(choice, HostedChoice):
        raise InvalidRequest(
            f"tool_choice names the hosted tool {choice.type!r}, which this server does not run",
            param="tool_choice",
        )
    if isinstance(choice, NamedChoice):
        name = table.resolve(choice.name, param="tool_choice.name")
        return ToolChoice(mode=ToolChoiceMode.NAMED, name=name), table
    return _allowed(choice, table)


def _allowed(choice: AllowedToolsChoice, table: ToolTable) -> tuple[ToolChoice, ToolTable]:
    names = set()
    for index, tool in enumerate(choice.tools):
        param = f"tool_choice.tools[{index}]"
        if tool.name is None:
            raise InvalidRequest(
                f"{param}: hosted tools ({tool.type!r}) are not run by this server", param=param
            )
        names.add(table.resolve(tool.name, param=param))
    # The way back keeps every name: only what is offered shrinks.
    allowed = ToolTable(tuple(spec for spec in table.specs if spec.name in names), table.refs)
    return ToolChoice(mode=_MODES[choice.mode]), allowed
