"""Exact patterns for the JSON Schema formats ``date``, ``time`` and ``date-time``.

llguidance implements these three formats with patterns that admit more than
a validator does: a leap second at any minute (``10:15:60Z``), the year
``0000`` and the 29th of February in any year. A model under such a grammar
writes, a few times in a hundred, a string that jsonschema, Pydantic and
Python's ``datetime.fromisoformat`` all refuse, although decoding was
"constrained". So a schema's date formats are replaced, before llguidance
sees it, by patterns that admit only what every one of them accepts: years
0001 to 9999, each month's own last day, the 29th of February in leap years,
hours 00 to 23, seconds 00 to 59 (a leap second is never written: where RFC 3339
allows one depends on the offset, which a pattern cannot weigh), ``T`` and
``Z`` in upper case. Generating a subset of the valid strings is sound; a
superset is not.

A schema that gives its own ``pattern`` beside the format keeps both as it
wrote them (llguidance cannot intersect two patterns).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_YEAR = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
#: Years divisible by 4, except centuries not divisible by 400 (and not 0000).
_LEAP_YEAR = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
    r"|02-(?:0[1-9]|1\d|2[0-8]))"
)
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d+)?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"

#: Each replaced format, as an anchored pattern (JSON Schema's are unanchored).
PATTERNS: Mapping[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
}

#: Keywords whose values are data, not schemas: never rewritten.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def exact_date_formats(schema: Any) -> Any:
    """``schema`` with each ``date``/``time``/``date-time`` format that has
    no ``pattern`` beside it replaced by :data:`PATTERNS`' (a copy; the
    caller's schema is not touched)."""
    if isinstance(schema, list):
        return [exact_date_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {
        key: value if key in _DATA_KEYWORDS else exact_date_formats(value)
        for key, value in schema.items()
    }
    form = schema.get("format")
    if isinstance(form, str) and form in PATTERNS and "pattern" not in schema:
        del rewritten["format"]
        rewritten["pattern"] = PATTERNS[form]
    return rewritten
