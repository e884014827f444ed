"""Parsing the human units people type into query strings and flags (and whether a host they
typed is this machine: :func:`is_loopback`).

Every parser raises :class:`ValueError` with a message that can be shown to the user as is,
and only that: the number is ASCII digits only (``²`` or ``٣`` are digits to ``int()`` but not
to anyone typing a query), at most :data:`MAX_NUMBER_CHARS` long, and the value is bounded, so
``min_free`` of 400 digits or ``1e999GiB`` is a refusal, never an OverflowError.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # nvidia-smi and most people write "M"/"G" meaning MiB/GiB.
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
# ASCII only: [0-9], [a-zA-Z] and, with re.ASCII, \s (no Unicode digits or spaces).
_NUMBER_UNIT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*\Z", re.ASCII)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0}
MAX_NUMBER_CHARS = 32  # digits and point: more is a typo or an attack, never a size or a time
MAX_BYTES = 2**60  # 1 EiB: far beyond any GPU, and exact as a float and an int
MAX_DURATION_SECONDS = 366 * 24 * 3600.0  # a year: no lease, wait or window is longer


def _number_unit(text: str, expected: str) -> tuple[float, str]:
    """The number (finite, ASCII digits) and the unit as written; ValueError names
    ``expected``."""
    m = _NUMBER_UNIT.match(text)
    if not m:
        raise ValueError(f"expected {expected}, got {shown(text)}")
    if len(m.group(1)) > MAX_NUMBER_CHARS:
        raise ValueError(f"at most {MAX_NUMBER_CHARS} digits, got {len(m.group(1))}")
    return float(m.group(1)), m.group(2)


def shown(text: str) -> str:
    """``text`` for a message: quoted, cut short when long, and a hint for non-ASCII digits.

    >>> shown("²"), shown("9" * 50)[-17:]
    ("'²' (ASCII digits only)", '… (50 characters)')
    """
    hint = " (ASCII digits only)" if any(c.isdigit() and not c.isascii() for c in text) else ""
    shown = repr(text)
    if len(text) > 40 or len(shown) > 60:  # escapes make the quoted text up to 10x longer
        return shown[:60] + f"… ({len(text)} characters){hint}"
    return shown + hint


def parse_bytes(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"500MB"``, ``"8G"`` (= GiB) or a plain byte count.

    >>> parse_bytes("8GiB"), parse_bytes("500MB"), parse_bytes("1024")
    (8589934592, 500000000, 1024)
    """
    expected = "a size such as 8GiB, 500MB or a byte count"
    return int(_scaled(text, expected, _BYTE_UNITS, MAX_BYTES, f"1 EiB ({MAX_BYTES} bytes)"))


def parse_ratio(text: str) -> float:
    """A ratio 0–1 from ``"0.3"`` or ``"30%"``.

    >>> parse_ratio("30%"), parse_ratio("0.3")
    (0.3, 0.3)
    """
    expected = "a ratio such as 0.3 or 30%"
    value, unit = _number_unit(text, expected)
    if unit not in ("", "%"):
        raise ValueError(f"expected {expected}, got {shown(text)}")
    if unit == "%":
        value /= 100.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"expected a ratio between 0 and 1 (or 0% and 100%), got {shown(text)}")
    return value


def parse_duration(text: str) -> float:
    """Seconds from ``"500ms"``, ``"90s"``, ``"10m"``, ``"2h"`` or plain seconds.

    >>> parse_duration("10m"), parse_duration("1.5")
    (600.0, 1.5)
    """
    expected = "a duration such as 30s, 10m or 1h"
    return _scaled(text, expected, _DURATION_UNITS, MAX_DURATION_SECONDS, "a year (8784h)")


def _scaled(text: str, expected: str, units: Mapping[str, float], most: float, said: str) -> float:
    """The number times its unit's factor (any case); at most ``most``, which ``said`` says."""
    number, unit = _number_unit(text, expected)
    if unit.lower() not in units:
        raise ValueError(f"expected {expected}, got {shown(text)}")
    value = number * units[unit.lower()]
    if value > most:
        raise ValueError(f"at most {said}, got {shown(text)}")
    return value


def format_bytes(n: float) -> str:
    """``"79.2 GiB"``: binary units, as nvidia-smi's MiB figures are."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 GPU"``, ``"2 GPUs"``: a count and its noun, for messages (``nouns``: an irregular
    plural).

    >>> plural(1, "GPU"), plural(0, "GPU"), plural(2, "lease"), plural(3, "entry", "entries")
    ('1 GPU', '0 GPUs', '2 leases', '3 entries')
    """
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
