"""The JSON-schema check of the structured-output tests checks every format
it names: a value outside the format is refused, one inside is taken."""

from __future__ import annotations

import jsonschema
import pytest

from tests.fixtures.json_schemas import FORMATS, assert_valid

#: Per format: a value in it, and one that is not (each a string, so that
#: only the format can refuse it).
SAMPLES = {
    "date": ("2024-02-29", "2023-02-29"),
    "time": ("12:30:05Z", "25:99"),
    "date-time": ("2026-12-06T05:54:00+00:00", "2026-12-06 noon"),
    "uuid": ("9f0c5e0e-3b6a-4f39-8d2e-1f2b3c4d5e6f", "9f0c5e0e-3b6a"),
    "ipv4": ("192.0.2.7", "192.0.2.300"),
    "ipv6": ("2001:db8::1", "2001:db8:::1"),
    "email": ("ada@example.org", "ada.example.org"),
    "hostname": ("api.example.org", "-bad-.example"),
    "duration": ("P3DT4H", "3 days"),
    "uri": ("https://example.org/a?b=c", "not a uri"),
}


def test_every_format_of_the_strategies_has_samples() -> None:
    assert set(SAMPLES) == set(FORMATS)


@pytest.mark.parametrize("name", FORMATS)
def test_a_format_is_checked(name: str) -> None:
    good, bad = SAMPLES[name]
    schema = {"type": "string", "format": name}
    assert_valid(good, schema)
    with pytest.raises(jsonschema.ValidationError, match="is not a"):
        assert_valid(bad, schema)
