from __future__ import annotations

import pytest

from gpu_exporter.units import format_bytes, parse_bytes, parse_duration, parse_ratio


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("8G", 8 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5 GiB", 3 * 2**29),
        ("123", 123),
        ("2tib", 2 * 2**40),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "8 parsecs", "1e9", "nan"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("text", "expected"), [("0.3", 0.3), ("30%", 0.3), ("0", 0.0), ("100%", 1.0)]
)
def test_parse_ratio(text: str, expected: float) -> None:
    assert parse_ratio(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["1.5", "101%", "x", "-0.1", "30 %%"])
def test_parse_ratio_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="ratio"):
        parse_ratio(text)


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("500ms", "90s", "10m", "2h", "3")] == [
        0.5,
        90,
        600,
        7200,
        3,
    ]
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (512, 2048, 79.5 * 2**30)] == ["512 B", "2.0 KiB", "79.5 GiB"]
