"""Tool calls drawn from a schema and written in a family's markup, with its
optional whitespace and options drawn too: what every parser must read back
exactly and every grammar must accept."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from sluiceway.parsers.formats import FORMATS
from sluiceway.parsers.formats.render import Call, Style, render
from sluiceway.parsers.formats.spec import MAX_WHITESPACE

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "hot": {"type": "boolean"},
        "unit": {"enum": ["c", "f"]},
        "ratio": {"type": "number"},
    },
    "required": ["city"],
    "additionalProperties": False,
}
CLOCK: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"type": "string"}},
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}

#: The reasoning dialect each family's models pair with (None: none).
REASONING = {
    "hermes": "qwen3",
    "qwen3_coder": "qwen3",
    "glm45": "glm45",
    "glm47": "glm45",
    "kimi_k2": "kimi_k2",
    "minimax_m2": "minimax_m2",
    "deepseek_v31": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "llama3_json": None,
    "pythonic": None,
    "mistral": "mistral",
}
assert set(REASONING) == set(FORMATS)

#: Strings any family can carry in any argument form (no markup, no newline at the ends).
_TEXT = st.text(st.sampled_from("abc XYZ-_.,:é{}[]'\"\\/\n€"), min_size=0, max_size=12).filter(
    lambda s: s == s.strip()
)


def _value(name: str, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return st.integers(-1000, 1000)
    if kind == "number":
        return st.integers(-999, 999).map(lambda n: n / 10)
    if kind == "boolean":
        return st.booleans()
    return _TEXT


@st.composite
def calls(draw: st.DrawFn, *, max_calls: int = 3) -> list[Call]:
    out = []
    for _ in range(draw(st.integers(1, max_calls))):
        name = draw(st.sampled_from(sorted(SCHEMAS)))
        schema = SCHEMAS[name]
        required = set(schema.get("required", ()))
        arguments = {}
        for key, prop in schema["properties"].items():
            if key in required or draw(st.booleans()):
                arguments[key] = draw(_value(key, prop))
        out.append(Call(name, arguments))
    return out


@dataclass
class DrawnStyle(Style):
    """Whitespace and options drawn by hypothesis."""

    data: st.DataObject

    def space(self, pre: str) -> str:
        spaces = st.text(st.sampled_from(" \t\r\n"), max_size=MAX_WHITESPACE)
        return self.data.draw(st.one_of(st.just(pre), spaces))

    def newline(self, pre: str) -> str:
        return self.data.draw(st.sampled_from(["", "\n"]))

    def pick(self, count: int) -> int:
        return self.data.draw(st.integers(0, count - 1))


def written(family: str, drawn: list[Call], data: st.DataObject) -> str:
    """The calls in the family's markup, nothing before them."""
    return render(FORMATS[family], drawn, DrawnStyle(data)).lstrip(" \t\r\n")


def expected_arguments(call: Call) -> str:
    """The arguments string the parser reports for ``call``."""
    return json.dumps(dict(call.arguments), ensure_ascii=False)
